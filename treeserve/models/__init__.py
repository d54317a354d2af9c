"""treeserve.models: Llama-family models over the paged KV cache, loaders, tokenizer.

```python
from treeserve.models import load
model, tokenizer = load("smollm2-135m-instruct", dtype=torch.float32)
```
"""

from __future__ import annotations

from treeserve.models.chat_template import ChatTemplateError
from treeserve.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, tiny_config
from treeserve.models.gguf_loader import load_gguf_model, open_gguf
from treeserve.models.hf_loader import load_hf_model
from treeserve.models.llama import LlamaForCausalLM, layer_subset, truncated_copy
from treeserve.models.loader import EMBEDDED_MODELS, LoadedModel, load, resolve_model_path
from treeserve.models.synthetic import random_model, save_hf_dir
from treeserve.models.tokenizer import StreamDecoder, Tokenizer
from treeserve.models.weights import MissingTensorError

__all__ = [
    "EMBEDDED_MODELS",
    "SUPPORTED_ARCHITECTURES",
    "ChatTemplateError",
    "LlamaForCausalLM",
    "LoadedModel",
    "MissingTensorError",
    "ModelConfig",
    "StreamDecoder",
    "Tokenizer",
    "layer_subset",
    "load",
    "load_gguf_model",
    "load_hf_model",
    "open_gguf",
    "random_model",
    "resolve_model_path",
    "save_hf_dir",
    "tiny_config",
    "truncated_copy",
]

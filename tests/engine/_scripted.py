"""A model that writes a fixed script (greedy), with the embedded SmolLM2 tokenizer: lets the
engine's text path (multi-byte characters, stop strings, streaming) be tested exactly and fast."""

from __future__ import annotations

import torch

from treeserve.models import Tokenizer, open_gguf, resolve_model_path, tiny_config

_TOKENIZER: Tokenizer | None = None


def smol_tokenizer() -> Tokenizer:
    """The embedded SmolLM2 tokenizer, read from the GGUF metadata only (no weights)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        md = open_gguf(resolve_model_path("smollm2-135m-instruct")).metadata
        _TOKENIZER = Tokenizer.from_gguf_metadata(md)
    return _TOKENIZER


class ScriptedModel(torch.nn.Module):
    """Greedy output ``script[k]`` for output token ``k`` of a prompt of ``prompt_len`` tokens;
    a row whose last position lies past the script gets ``fill``. Writes no KV (attention-free)."""

    def __init__(self, script: list[int], prompt_len: int, vocab_size: int, fill: int = 0) -> None:
        super().__init__()
        self.config = tiny_config("llama", vocab_size=vocab_size, eos_token_ids=(), max_position_embeddings=4096)
        self.script = torch.tensor(script + [fill], dtype=torch.long)
        self.prompt_len = prompt_len
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the engine a dtype
        self.vocab_size = vocab_size

    def forward(self, input_ids, positions, kv, out_slots, meta, logits_indices):
        k = (positions[logits_indices] + 1 - self.prompt_len).clamp(0, len(self.script) - 1)
        logits = torch.zeros(len(logits_indices), self.vocab_size)
        logits[torch.arange(len(k)), self.script[k]] = 30.0
        return logits

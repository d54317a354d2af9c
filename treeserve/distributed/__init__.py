"""treeserve.distributed: tensor parallelism over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

```python
from treeserve import LLM
llm = LLM("smollm2-135m-instruct", tensor_parallel_size=3)  # launches ranks 1..2 itself
```

:func:`launch_tensor_parallel` starts the worker processes and returns rank 0's
:class:`TensorParallelModel`, which the engine calls like any model. Layers are in
``treeserve.models.parallel``; the per-step wire format in :mod:`.protocol`.
"""

from __future__ import annotations

from treeserve.distributed.comm import CollectiveError, Communicator
from treeserve.distributed.tensor_parallel import TensorParallelError, TensorParallelModel, launch_tensor_parallel

__all__ = [
    "CollectiveError",
    "Communicator",
    "TensorParallelError",
    "TensorParallelModel",
    "launch_tensor_parallel",
]

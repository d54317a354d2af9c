"""Test-suite configuration shared by every subpackage.

- Triton kernels run under the interpreter on machines without CUDA: TRITON_INTERPRET must be
  set before triton is first imported, so it is set here, at collection time.
- Hypothesis profiles: ``ci`` (derandomized, bounded; ``make test``) and ``long`` (``make test-long``).
- ``@pytest.mark.gpu`` tests skip cleanly when CUDA is absent.
- ``TREESERVE_DEBUG_CHECKS=1``: the value checks that read device data on the host (slot ranges,
  page indices, allocator double frees) run in tests; production steps skip them.
- ``TREESERVE_CACHE_DIR``: a temporary folder per session (load-time measurements), removed at exit.
- ``TREESERVE_REMEASURE_SHARE=1``: a measurement is kept whatever else shared the CPUs, so that a
  busy CI host never adds a measurement to a test that counts them (the re-measuring has its own
  tests, which unset it).
"""

from __future__ import annotations

import os


def _cuda_present() -> bool:
    # Decided without importing triton; torch import is fine (it does not import triton eagerly).
    import torch

    return torch.cuda.is_available()


os.environ.setdefault("TREESERVE_DEBUG_CHECKS", "1")

# Load-time measurements (treeserve._tuning) go to a per-session folder, whatever the developer's
# environment says: the suite never reads (or removes) a real cache.
import atexit, shutil, tempfile  # noqa: E401, E402

os.environ["TREESERVE_CACHE_DIR"] = _session_cache = tempfile.mkdtemp(prefix="treeserve-test-cache-")
atexit.register(shutil.rmtree, _session_cache, ignore_errors=True)
os.environ["TREESERVE_REMEASURE_SHARE"] = "1"

if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=600,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=20, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_present():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

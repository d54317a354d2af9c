"""``treeserve._cpu.release_free_memory``: freed C-heap pages go back to the OS."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest

from treeserve._cpu import release_free_memory

STATUS = Path("/proc/self/status")


def _rss_mb() -> float:
    for line in STATUS.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("VmRSS missing from /proc/self/status")


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "malloc_trim") and platform.libc_ver()[0] == "glibc"
    except OSError:
        return False


@pytest.mark.skipif(not STATUS.exists() or not _glibc(), reason="needs Linux /proc and glibc")
def test_freed_heap_pages_return_to_the_os() -> None:
    """~150 MB of 2 KB heap blocks (above pymalloc's limit: glibc's heap, below its mmap threshold),
    freed but for one block at the end that pins the heap top: glibc keeps the pages until trimmed."""
    release_free_memory()
    blocks = [bytes(2048) for _ in range(75_000)]
    pin = bytes(2048)
    del blocks
    before = _rss_mb()
    assert release_free_memory()
    assert before - _rss_mb() > 100, (before, _rss_mb())
    assert len(pin) == 2048

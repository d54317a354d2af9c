"""Build the C++ operators once, in the test process, before any replica starts: on a fresh clone
these tests may be the suite's first users of them, and two replicas starting at once would both
wait on (and one of them pay for) the build inside their start-up deadline."""

from __future__ import annotations

import pytest

from treeserve import _cpp


@pytest.fixture(scope="session", autouse=True)
def _cpp_ops_built() -> None:
    _cpp.load_all_cpp_ops()

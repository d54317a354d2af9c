"""Fixtures for the model tests. transformers is the oracle (test-only, offline)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from treeserve.models import LoadedModel, load, resolve_model_path  # noqa: E402

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smol_path():
    return resolve_model_path(SMOL)


@pytest.fixture(scope="session")
def smol(smol_path) -> LoadedModel:
    """The embedded SmolLM2 in float32 (loaded once per session)."""
    return load(SMOL, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    """transformers' own load of the same GGUF file (dequantized by transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smol_path.parent), gguf_file=smol_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_smol_tokenizer(smol_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)

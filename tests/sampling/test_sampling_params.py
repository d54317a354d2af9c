"""SamplingParams validation and SamplingBatch.build input checks."""

from __future__ import annotations

import pytest

from treeserve.sampling import SamplingBatch, SamplingParams

BAD_VALUES = [
    ("temperature", -0.1, ValueError, "temperature"),
    ("temperature", float("nan"), ValueError, "temperature"),
    ("temperature", "1", TypeError, "temperature"),
    ("top_k", 0, ValueError, "top_k"),
    ("top_k", -2, ValueError, "top_k"),
    ("top_k", 1.5, TypeError, "top_k"),
    ("top_p", 0.0, ValueError, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.01, ValueError, "top_p"),
    ("min_p", -0.1, ValueError, r"min_p must be in \[0, 1\)"),
    ("min_p", 1.0, ValueError, "min_p"),
    ("repetition_penalty", 0.0, ValueError, "repetition_penalty"),
    ("repetition_penalty", float("inf"), ValueError, "repetition_penalty"),
    ("frequency_penalty", 2.5, ValueError, r"frequency_penalty must be in \[-2, 2\]"),
    ("presence_penalty", -2.01, ValueError, "presence_penalty"),
    ("logit_bias", {-1: 1.0}, ValueError, "logit_bias"),
    ("logit_bias", {3: float("nan")}, ValueError, "logit_bias"),
    ("logit_bias", [(1, 2.0)], TypeError, "logit_bias"),
    ("allowed_token_ids", [], ValueError, "allowed_token_ids"),
    ("allowed_token_ids", [1, -3], ValueError, "allowed_token_ids"),
    ("allowed_token_ids", [1.0], TypeError, "allowed_token_ids"),
    ("seed", -1, ValueError, "seed"),
    ("seed", 2**63, ValueError, "seed"),
    ("seed", 1.0, TypeError, "seed"),
    ("max_new_tokens", 0, ValueError, "max_new_tokens"),
    ("min_new_tokens", -1, ValueError, "min_new_tokens"),
    ("min_new_tokens", 1000, ValueError, "min_new_tokens"),
    ("stop", ["ok", ""], ValueError, "stop"),
    ("stop", [3], ValueError, "stop"),
    ("stop_token_ids", [-5], ValueError, "stop_token_ids"),
    ("stop_token_ids", "abc", TypeError, "stop_token_ids"),
    ("ignore_eos", 1, TypeError, "ignore_eos"),
    ("n", 0, ValueError, "n must be >= 1"),
    ("logprobs", -1, ValueError, "logprobs"),
    ("logprobs", 21, ValueError, r"logprobs must be None or in \[0, 20\]"),
    ("logprobs", True, TypeError, "logprobs"),
    ("structured", "json", TypeError, r"structured must be a StructuredOutput, a dict or None"),
    ("structured", {"regex": "a", "choice": ["a"]}, ValueError, r"structured must set exactly one of"),
]


@pytest.mark.parametrize(("field", "value", "exc", "match"), BAD_VALUES)
def test_bad_field_raises_naming_it(field: str, value: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        SamplingParams(**{field: value})


def test_every_field_has_a_bad_value_case() -> None:
    covered = {f for f, *_ in BAD_VALUES}
    assert covered == set(SamplingParams.__dataclass_fields__)


def test_defaults_and_normalization() -> None:
    p = SamplingParams(stop="###", top_k=3, temperature=0, allowed_token_ids=[4, 2], stop_token_ids=[7])
    assert p.stop == ("###",)
    assert p.allowed_token_ids == (4, 2)
    assert p.stop_token_ids == (7,)
    assert p.greedy
    assert isinstance(p.temperature, float)
    assert not SamplingParams().greedy


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(logit_bias={10: 1.0}),
        SamplingParams(allowed_token_ids=[0, 10]),
        SamplingParams(stop_token_ids=[12]),
    ],
)
def test_out_of_vocab_ids_rejected(params: SamplingParams) -> None:
    params.validate_for_vocab(13)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        params.validate_for_vocab(10)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        SamplingBatch.build([params], [0], [[]], 10)


def test_build_checks_arguments() -> None:
    p = SamplingParams()
    with pytest.raises(ValueError, match="seeds has 2 entries"):
        SamplingBatch.build([p], [0, 1], [[]], 10)
    with pytest.raises(ValueError, match="histories has 0 entries"):
        SamplingBatch.build([p], [0], [], 10)
    with pytest.raises(ValueError, match="seeds"):
        SamplingBatch.build([p], [-1], [[]], 10)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingBatch.build([p], [0], [[]], 0)
    with pytest.raises(ValueError, match="eos_token_ids"):
        SamplingBatch.build([p], [0], [[]], 10, eos_token_ids=[10])
    with pytest.raises(TypeError, match=r"params\[0\]"):
        SamplingBatch.build([{"temperature": 1.0}], [0], [[]], 10)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="num_generated is required"):
        SamplingBatch.build([SamplingParams(min_new_tokens=2)], [0], [[1]], 10)
    with pytest.raises(ValueError, match=r"num_generated\[0\]"):
        SamplingBatch.build([p], [0], [[1]], 10, num_generated=[2])
    with pytest.raises(ValueError, match=r"histories\[0\]"):
        SamplingBatch.build([SamplingParams(presence_penalty=1.0)], [0], [[11]], 10)

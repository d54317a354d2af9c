"""Self-speculation's layer choice (``runner.self_draft``) and the layer-skipping drafter model
(``models.layer_subset``): a layer that leaves the hidden state as it is (zeroed output
projections) has no influence, is the first one skipped, and skipping it leaves the logits as
they were."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.models import layer_subset, random_model, tiny_config, truncated_copy
from treeserve.runner import PagedSequence, layer_influence, self_draft_layers

LAYERS = 5
IDS = [5, 17, 3, 99, 42, 8, 8, 200, 31, 64, 7, 150]


def _model(identity: int | None = None) -> torch.nn.Module:
    model = random_model(tiny_config("llama", num_layers=LAYERS), seed=11, init_std=0.1)
    if identity is not None:  # x + attn(x) + mlp(x) with both outputs exactly zero: the identity
        layer = model.layers[identity]
        with torch.no_grad():
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    return PagedSequence(model, len(IDS)).extend(IDS, all_logits=True)


@settings(max_examples=10, deadline=None)
@given(identity=st.integers(0, LAYERS - 1))
def test_an_identity_layer_has_no_influence_and_is_skipped_first(identity: int) -> None:
    model = _model(identity)
    influence = layer_influence(model, IDS)
    assert len(influence) == LAYERS
    assert abs(influence[identity]) < 1e-6
    assert all(v > 1e-4 for i, v in enumerate(influence) if i != identity)
    keep = self_draft_layers(model, LAYERS - 1, IDS)
    assert keep == [i for i in range(LAYERS) if i != identity]
    assert all(not layer._forward_hooks for layer in model.layers)  # the probe's hooks are gone
    draft = layer_subset(model, keep)
    assert draft.config.num_layers == LAYERS - 1 and all(a is model.layers[i] for a, i in zip(draft.layers, keep))
    torch.testing.assert_close(_logits(draft), _logits(model), rtol=0, atol=1e-5)


def test_the_most_influential_layers_are_kept_in_order() -> None:
    model = _model()
    influence = layer_influence(model, IDS)
    for n in range(1, LAYERS + 1):
        keep = self_draft_layers(model, n, IDS)
        assert keep == sorted(keep) and len(keep) == n
        dropped = [i for i in range(LAYERS) if i not in keep]
        assert all(influence[k] >= influence[d] for k in keep for d in dropped)


def test_without_a_calibration_text_the_first_layers_are_kept() -> None:
    model = _model()
    assert self_draft_layers(model, 3, None) == [0, 1, 2]
    assert self_draft_layers(model, 3, IDS[:1]) == [0, 1, 2]  # one token: nothing to compare
    torch.testing.assert_close(_logits(layer_subset(model, [0, 1, 2])), _logits(truncated_copy(model, 3)), rtol=0, atol=0)


def test_a_calibration_text_longer_than_the_model_is_cut_to_its_positions() -> None:
    short = random_model(tiny_config("llama", num_layers=LAYERS, max_position_embeddings=8), seed=11, init_std=0.1)
    assert self_draft_layers(short, 3, IDS * 4) == self_draft_layers(short, 3, IDS[:8])


@pytest.mark.parametrize("n", [0, LAYERS + 1, -1, True, 2.0, "3"])
def test_bad_layer_counts_are_refused(n: object) -> None:
    with pytest.raises(ValueError, match=r"draft:self:N needs N an int in \[1, 5\]"):
        self_draft_layers(_model(), n, IDS)  # type: ignore[arg-type]


@pytest.mark.parametrize("layers", [[], [2, 1], [0, 0], [-1, 2], [0, LAYERS], [True], [0.0]])
def test_bad_layer_subsets_are_refused(layers: list[object]) -> None:
    with pytest.raises(ValueError, match=r"layers must be increasing ints in \[0, 5\)"):
        layer_subset(_model(), layers)  # type: ignore[arg-type]


def test_influence_needs_two_tokens() -> None:
    with pytest.raises(ValueError, match="at least 2 tokens"):
        layer_influence(_model(), [3])

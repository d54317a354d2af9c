"""Draft rows ride the path of the step's plain rows (``quant.plain_rows``): a GGUF model whose
projections take their large-batch path above one row (``TREESERVE_PACKED_MAX_ROWS=1``) verifies a
chain of any length on the int16 kernel, so every row is bitwise what a one-row decode step gives
(fused C++ layers and Python layers alike), and greedy speculation with long drafts keeps plain
decoding's output (eager and static steps). Without the context the same chain takes the large
path and its rows differ: the context is what keeps them exact."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from treeserve import LLM, SamplingParams
from treeserve._tuning import clear_memo
from treeserve.kvcache import KVPool
from treeserve.models import load
from treeserve.models.gguf_op import gguf_op_available
from treeserve.models.quant import PackedLinear, plain_rows, routed_rows
from treeserve.models.synthetic_gguf import SyntheticSpec, write_synthetic_gguf
from treeserve.runner import PagedSequence
from treeserve.runner.inputs import build_step_inputs

from .test_speculative import repetitive_prompts

SPEC = SyntheticSpec("llama", 2, 128, 4, 2, 192, 320, True, False, 10000.0, 256)
PREFIX = [5, 9, 13, 9, 5, 20, 31, 7]
CHAIN = [11, 3, 40, 22, 17, 8, 50]

pytestmark = pytest.mark.skipif(not gguf_op_available(), reason="needs the C++ GGUF operator")


@pytest.fixture(scope="module", params=["Q4_0", "Q8_0"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    tmp = tmp_path_factory.mktemp("plain-rows")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TREESERVE_CACHE_DIR", str(tmp / "cache"))
        mp.setenv("TREESERVE_PACKED_MAX_ROWS", "1")  # two rows and more: the large-batch path
        clear_memo()
        m, _ = load(write_synthetic_gguf(tmp / "m.gguf", SPEC, request.param, seed=4), quantization="auto")
    clear_memo()
    packed = [p for p in m.modules() if isinstance(p, PackedLinear)]
    assert packed and all(p.packed_max_rows == 1 and p.qtype == request.param for p in packed)
    return m


def _hidden(model: torch.nn.Module, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``run()``'s logits and the final norm's output of its last forward (the hidden states the
    head reads: its exact re-scoring keeps each row's greedy pick, not every logit's last bit)."""
    seen: list[torch.Tensor] = []
    hook = model.norm.register_forward_hook(lambda mod, args, out: seen.append(out.clone()))
    try:
        logits = run()
    finally:
        hook.remove()
    return seen[-1], logits


def _verified(model: torch.nn.Module, rows: int | None, tree: bool = True) -> torch.Tensor:
    """Logits of ``CHAIN`` as one verify step's chain after ``PREFIX`` (within ``plain_rows(rows)``
    unless None), given as a tree (its parents) or, as the eager runner gives a step of chains, as a
    causal chunk."""
    seq = PagedSequence(model, 32, page_size=4)
    seq.extend(PREFIX)
    n = len(CHAIN)
    parents = (torch.arange(n) - 1)[None] if tree else None
    step = build_step_inputs(seq._slots[None], [0], [len(PREFIX)], [n], CHAIN, 4, [n], parents=parents)
    with torch.inference_mode(), plain_rows(rows) if rows else nullcontext():
        return model(step.input_ids, step.positions, seq.pool, step.out_slots, step.meta, step.logits_indices)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "python"])
def test_a_verify_chain_on_the_plain_rows_path_is_each_row_alone(model: torch.nn.Module, fused: bool) -> None:
    if not fused:
        model._decode_plan = None  # the Python layers
    try:
        if fused:
            assert model.decode_plan() is not None
        seq = PagedSequence(model, 32, page_size=4)
        seq.extend(PREFIX)
        steps = [_hidden(model, lambda t=t: seq.extend([t])) for t in CHAIN]
        alone_h, alone_logits = torch.cat([h for h, _ in steps]), torch.cat([lg for _, lg in steps])
        for tree in (True, False):
            h, logits = _hidden(model, lambda tree=tree: _verified(model, 1, tree))
            assert torch.equal(h, alone_h)
            assert torch.equal(logits.argmax(-1), alone_logits.argmax(-1))
        h, _ = _hidden(model, lambda: _verified(model, None))
        assert not torch.equal(h, alone_h)  # 7 rows: the large path, other roundings
    finally:
        model._decode_plan = False


@pytest.mark.parametrize("kw", [{}, {"cuda_graph": True}], ids=["eager", "static"])
def test_greedy_speculation_with_long_drafts_keeps_plain_decoding(model: torch.nn.Module, kw: dict,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Chains of up to 7 draft nodes (self-speculation drafts whole rooms; the random model's
    loops give n-gram drafts of one node), every node past the first row on the plain rows' path
    (the runner enters ``plain_rows`` with a lone request's one row), one request and a batch of
    several: the output is plain decoding's."""
    import treeserve.runner.eager as eager
    import treeserve.runner.graph as graph

    routed: list[int] = []

    def spy(rows: int):  # noqa: ANN202
        routed.append(rows)
        return plain_rows(rows)

    monkeypatch.setattr(eager, "plain_rows", spy)
    monkeypatch.setattr(graph, "plain_rows", spy)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    for prompts in ([repetitive_prompts(7, 1)[0]], repetitive_prompts(8, 5)):
        routed.clear()
        plain = LLM((model, None), speculative=None, **kw).generate(prompts, params, use_tqdm=False)
        llm = LLM((model, None), speculative="draft:self:1", num_speculative_tokens=7, speculative_row_cost=0.0, **kw)
        spec = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
        m = llm.metrics
        assert m.accepted_tokens > 0 and m.draft_tokens >= 3 * m.verify_steps, "long drafts should be verified"
        assert routed and (len(prompts) > 1 or set(routed) == {1})


def test_plain_rows_scope_and_bad_input() -> None:
    assert routed_rows(9) == 9
    with plain_rows(2):
        assert routed_rows(9) == 2
        with plain_rows(5):
            assert routed_rows(1) == 5
        assert routed_rows(9) == 2
    assert routed_rows(9) == 9
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="rows must be an int >= 1"), plain_rows(bad):  # type: ignore[arg-type]
            pass


def test_the_row_cost_is_measured_on_the_plain_rows_path(model: torch.nn.Module, monkeypatch, tmp_path: Path) -> None:
    """``measure_step_costs`` times its draft rows within ``plain_rows(1)``, as verify steps run."""
    import treeserve.models.quant as quant
    from treeserve.runner import measure_step_costs

    monkeypatch.setenv("TREESERVE_CACHE_DIR", str(tmp_path))
    clear_memo()
    seen: list[int | None] = []
    real = PackedLinear.forward

    def spy(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        seen.append(quant._PLAIN_ROWS.get())
        return real(self, x)

    monkeypatch.setattr(PackedLinear, "forward", spy)
    model._decode_plan = None  # the Python layers call each projection
    try:
        c = model.config
        kv = KVPool(c.num_layers, 64, 1, c.num_kv_heads, c.head_dim, torch.float32)
        assert len(measure_step_costs(model, kv, 5, context=16)) == 5
    finally:
        model._decode_plan = False
        clear_memo()
    assert seen and set(seen) == {1}

"""Sharding arithmetic, sharded loading and the step wire format, without any process group."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.distributed._helpers import tiny_model
from treeserve.distributed.protocol import Op, pack_compact, pack_forward, pack_stop, payload_len, unpack
from treeserve.kvcache import AttentionMetadata, select_backend
from treeserve.models import save_hf_dir
from treeserve.models.hf_loader import load_hf_model
from treeserve.models.parallel import TPShard, check_shard_quantization, check_tensor_parallel, shard_range
from treeserve.models.weights import expected_hf_shapes, hf_state_dict


@given(total=st.integers(1, 500), world=st.integers(1, 9))
def test_shard_ranges_partition_evenly(total: int, world: int) -> None:
    ranges = [shard_range(total, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("rank, world", [(-1, 2), (2, 2), (0, 0), (0, True)])
def test_bad_shard(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="rank|tensor_parallel_size"):
        TPShard(rank, world)


def test_check_tensor_parallel_names_both_numbers() -> None:
    config = tiny_model().config  # 4 query / 2 KV heads
    check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\).*\(4\)"):
        check_tensor_parallel(config, 4)
    with pytest.raises(ValueError, match="quantization must be None"):
        check_shard_quantization(TPShard(0, 2), "int8")


@pytest.mark.parametrize("world", [1, 2])
def test_weight_slices_reassemble_every_tensor(world: int) -> None:
    config = tiny_model().config
    for name, shape in expected_hf_shapes(config).items():
        cuts = [TPShard(r, world).weight_slice(name, config) for r in range(world)]
        if cuts[0] is None:
            assert all(c is None for c in cuts), name  # replicated (norms)
            continue
        dims = {c[0] for c in cuts}
        assert len(dims) == 1, name
        (dim,) = dims
        assert [c[1] for c in cuts][0] == 0 and cuts[-1][2] == shape[dim], name
        assert all(a[2] == b[1] for a, b in zip(cuts, cuts[1:])), name


def test_sharded_hf_load_holds_the_right_slices(tmp_path) -> None:
    full = tiny_model()
    cfg = full.config
    hf = hf_state_dict(full)
    path = save_hf_dir(full, tmp_path / "m")
    hd, world = cfg.head_dim, 2
    for rank in range(world):
        part = load_hf_model(path, shard=TPShard(rank, world))
        q0, q1 = shard_range(cfg.num_heads, rank, world)
        k0, k1 = shard_range(cfg.num_kv_heads, rank, world)
        i0, i1 = shard_range(cfg.intermediate_size, rank, world)
        v0, v1 = shard_range(cfg.vocab_size, rank, world)
        p = "model.layers.1."
        qkv = torch.cat([
            hf[p + "self_attn.q_proj.weight"][q0 * hd : q1 * hd],
            hf[p + "self_attn.k_proj.weight"][k0 * hd : k1 * hd],
            hf[p + "self_attn.v_proj.weight"][k0 * hd : k1 * hd],
        ])  # fmt: skip
        layer = part.layers[1]
        assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
        assert torch.equal(layer.self_attn.o_proj.weight, hf[p + "self_attn.o_proj.weight"][:, q0 * hd : q1 * hd])
        gate_up = torch.cat([hf[p + "mlp.gate_proj.weight"][i0:i1], hf[p + "mlp.up_proj.weight"][i0:i1]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(layer.mlp.down_proj.weight, hf[p + "mlp.down_proj.weight"][:, i0:i1])
        assert torch.equal(part.embed_tokens.weight, hf["model.embed_tokens.weight"][v0:v1])
        assert torch.equal(part.lm_head.weight, hf["lm_head.weight"][v0:v1])
        assert torch.equal(part.norm.weight, hf["model.norm.weight"])
        assert part.kv_heads_per_rank == cfg.num_kv_heads // world and part.config == cfg


@pytest.mark.parametrize("tree", [False, True])
def test_forward_message_round_trips(tree: bool) -> None:
    qo, kv = [3, 1], [7, 4]
    meta = AttentionMetadata.build(qo, kv, [[4, 5], [9]], page_size=4,
                                   tree_parents=[[-1, 0, 0], None] if tree else None)  # fmt: skip
    meta.attention_backend = select_backend("paged_attention", "torch_per_request")
    ids, pos = torch.tensor([5, 6, 7, 8]), torch.tensor([4, 5, 5, 3])
    slots, rows = torch.tensor([20, 21, 22, 36]), torch.tensor([2, 3])
    header, payload = pack_forward(4, 11, ids, pos, slots, meta, rows)
    h = header.tolist()
    assert payload.dtype == torch.int64 and payload.numel() == payload_len(h)
    step = unpack(h, payload)
    assert (step.op, step.pool_id, step.num_pages, step.page_size) == (Op.FORWARD, 4, 11, 4)
    got_ids, got_pos, got_slots, got, got_rows = step.forward
    for a, b in ((got_ids, ids), (got_pos, pos), (got_slots, slots), (got_rows, rows)):
        assert torch.equal(a, b)
    for name in ("qo_indptr", "kv_indptr", "kv_page_indices", "kv_last_page_len", "tree_mask", "tree_mask_indptr"):
        a, b = getattr(got, name), getattr(meta, name)
        assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype), name
    assert (got.max_qo_len, got.max_kv_len, got.num_qo_tokens) == (3, 7, 4)
    assert got.attention_backend.name == "torch_per_request"


def test_compact_and_stop_messages_round_trip() -> None:
    src, dst = torch.tensor([9, 12]), torch.tensor([7, 8])
    header, payload = pack_compact(1, 30, 2, src, dst)
    step = unpack(header.tolist(), payload)
    assert step.op == Op.COMPACT and step.pool_id == 1 and (step.num_pages, step.page_size) == (30, 2)
    assert torch.equal(step.moves[0], src) and torch.equal(step.moves[1], dst)
    header, payload = pack_stop()
    assert unpack(header.tolist(), payload).op == Op.STOP and payload_len(header.tolist()) == 0

"""KV tiers end to end on the embedded SmolLM2: a prefix evicted from the device pool and promoted
back from host memory or from disk (also after a restart) gives the recomputed greedy output; a
damaged or foreign disk tier costs a recompute, never wrong output; bad tier settings are refused."""

from __future__ import annotations

import logging

import pytest

from treeserve import LLM, SamplingParams
from treeserve.engine import EngineConfig

GREEDY = SamplingParams(temperature=0, max_new_tokens=8)
SYSTEM = ("You are a careful assistant for a small library. Answer questions about opening hours, "
          "loans, late fees and the reading room. Keep answers short and polite. ") * 5  # fmt: skip
PROMPT = SYSTEM + "Question: can I borrow three books at once?"
OTHER = ("Write a limerick about a cat who learns to play the violin at night, "
         "annoying every neighbour on the street. ") * 8  # fmt: skip


@pytest.fixture(scope="module")
def model_pair():  # noqa: ANN201
    llm = LLM(kv_cache_tokens=2048)  # the default configuration's model, loaded once
    return llm.model, llm.tokenizer


@pytest.fixture(scope="module")
def recomputed(model_pair) -> list[int]:  # noqa: ANN001
    llm = LLM(model_pair, kv_cache_tokens=2048, enable_prefix_cache=False)
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def run(llm: LLM, prompt: str = PROMPT) -> list[int]:
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.error is None
    llm.scheduler.check_invariants()
    return out.outputs[0].token_ids


def test_prefix_promoted_from_host_equals_recomputed(model_pair, recomputed) -> None:  # noqa: ANN001
    llm = LLM(model_pair, kv_cache_tokens=256, kv_host_tokens=4096)
    assert llm.tiers is not None and llm.tiers.disk is None
    assert run(llm) == recomputed
    run(llm, OTHER)  # needs the pool: the first prompt's KV is demoted to host memory
    assert llm.metrics.kv_tiers.bytes_device_to_host > 0
    before = llm.metrics.cached_prompt_tokens
    assert run(llm) == recomputed
    m = llm.metrics
    t = m.kv_tiers
    assert t.host_hit_tokens >= 128 and t.bytes_host_to_device > 0 and t.disk_hit_tokens == 0
    assert m.cached_prompt_tokens - before >= 128
    assert 0 < m.as_dict()["kv_host_hit_rate"] < 1


def test_disk_tier_survives_a_restart_damage_means_recompute_other_layouts_never_read(model_pair, recomputed, tmp_path, caplog) -> None:  # noqa: ANN001
    first = LLM(model_pair, kv_cache_tokens=256, kv_host_tokens=0, kv_disk_dir=str(tmp_path))
    assert run(first) == recomputed
    first.radix.evict(first.radix.evictable_tokens)  # gone from the device; written through to disk
    assert run(first) == recomputed
    assert first.metrics.kv_tiers.disk_hit_tokens >= 128
    first.close()
    files = sorted(tmp_path.glob("*.kv"))
    assert files and first.metrics.kv_tiers.bytes_to_disk > 0

    restarted = LLM(model_pair, kv_cache_tokens=256, kv_disk_dir=str(tmp_path))  # a new process, same directory
    assert run(restarted) == recomputed
    assert restarted.metrics.kv_tiers.disk_hit_tokens >= 128 and restarted.metrics.kv_tiers.disk_errors == 0
    restarted.close()

    for path in files:  # flip one byte in every entry
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)
    damaged = LLM(model_pair, kv_cache_tokens=256, kv_disk_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="treeserve.kvcache"):
        assert run(damaged) == recomputed
    assert "recomputing" in caplog.text and damaged.metrics.kv_tiers.disk_errors >= 1
    assert damaged.metrics.kv_tiers.disk_hit_tokens == 0
    damaged.close()  # the first bad entry was deleted and written through again from the recomputed KV
    assert len(list(tmp_path.glob("*.kv"))) == len(files)

    # Another page layout (and so another key seed) never reads them.
    paged = LLM(model_pair, kv_cache_tokens=256, page_size=16, kv_disk_dir=str(tmp_path))
    assert run(paged) == recomputed
    assert paged.metrics.kv_tiers.disk_hit_tokens == 0 and paged.metrics.kv_tiers.disk_errors == 0
    paged.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"kv_host_tokens": -1}, ValueError, "kv_host_tokens"),
        ({"kv_host_tokens": 1.5}, ValueError, "kv_host_tokens"),
        ({"kv_disk_bytes": -1}, ValueError, "kv_disk_bytes"),
        ({"kv_disk_dir": 3}, TypeError, "kv_disk_dir"),
        ({"kv_host_tokens": 64, "enable_prefix_cache": False}, ValueError, "enable_prefix_cache"),
    ],
)
def test_bad_tier_settings(kwargs: dict, error: type, field: str) -> None:
    with pytest.raises(error, match=field):
        EngineConfig(**kwargs)


def test_unwritable_disk_dir(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="kv_disk_dir"):
        EngineConfig(kv_disk_dir=str(blocker / "kv"))


def test_host_tier_default_is_off_on_cpu() -> None:
    assert EngineConfig().host_tokens() == 0
    assert EngineConfig(kv_host_tokens=100).host_tokens() == 100


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat"], ["serve"]])
def test_cli_flags_reach_the_engine(command: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from treeserve import cli

    seen: dict = {}
    monkeypatch.setattr(cli, "LLM", lambda model, **kw: seen.update(kw))
    flags = ["--kv-host-tokens", "4096", "--kv-disk-dir", str(tmp_path), "--kv-disk-bytes", "1000000"]
    cli._make_llm(cli.build_parser().parse_args([*command, *flags]))
    assert (seen["kv_host_tokens"], seen["kv_disk_dir"], seen["kv_disk_bytes"]) == (4096, str(tmp_path), 1000000)
    cli._make_llm(cli.build_parser().parse_args(command))
    assert (seen["kv_host_tokens"], seen["kv_disk_dir"]) == (None, None)  # defaults: EngineConfig decides

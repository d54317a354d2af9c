"""In-process HTTP tests (httpx over ASGI) of every endpoint, field and error path, against the
engine's own ``generate`` as the reference."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch

from treeserve import SamplingParams
from treeserve.server.engine_client import AsyncLLMEngine
from treeserve.server.protocol import ChatCompletionRequest, CompletionRequest, sampling_params

from ..engine.test_engine import PoisonedModel
from ._helpers import MODEL, assert_engine_drained, async_wait_until, http, running, scripted_llm, sse_events, synthetic_llm

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLMEngine(synthetic_llm())
    with running(eng):
        yield eng


@pytest.fixture(scope="module")
def ref():
    """A second engine with the same weights: the reference for what the server returns."""
    return synthetic_llm()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def post(engine, path: str, body: dict, name: str = MODEL):
    async with http(engine, name) as c:
        return await c.post(path, json=body)


def chat_ids(llm, msgs=MSGS) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))


def test_info_endpoints(engine) -> None:
    async def go():
        async with http(engine) as c:
            models = (await c.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"
            assert models["data"][0]["max_model_len"] == engine.max_model_len
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/version")).json()["version"] == __import__("treeserve").__version__
            assert (await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})).status_code == 200
            metrics = await c.get("/metrics")
            assert metrics.headers["content-type"].startswith("text/plain")
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
                         "vllm:kv_cache_usage_perc", "vllm:gpu_prefix_cache_hit_rate",
                         "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                         "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                         "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                         "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
                         "vllm:spec_decode_num_drafts_total", "treeserve:jump_forward_proposed_tokens_total",
                         "treeserve:jump_forward_tokens_total"):  # fmt: skip
                assert f"\n{name}{{" in metrics.text, name
            assert 'vllm:generation_tokens_total{model_name="tiny-synthetic"} 3.0' in metrics.text
            steps = re.search(r'^treeserve:engine_steps_total{model_name="tiny-synthetic"} (\S+)$', metrics.text, re.M)
            busy = re.search(r'^treeserve:engine_busy_seconds_total{model_name="tiny-synthetic"} (\S+)$', metrics.text,
                             re.M)  # fmt: skip
            assert steps and float(steps.group(1)) >= 1 and busy and float(busy.group(1)) > 0
            timed = re.search(r'^treeserve:engine_step_seconds_count{model_name="tiny-synthetic"} (\S+)$', metrics.text,
                              re.M)  # fmt: skip
            assert timed and float(timed.group(1)) >= float(steps.group(1))  # every step timed (and idle polls)
            missing = await c.get("/v1/nothing")
            assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
            assert (await c.get("/v1/chat/completions")).status_code == 405

    run(go())


def test_every_field_maps_onto_sampling_params() -> None:
    chat = ChatCompletionRequest(
        messages=MSGS, n=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={"17": 5.0, "9": -100}, seed=123,
        stop=["x", "yz"], stop_token_ids=[4, 5], ignore_eos=True, min_tokens=2, max_tokens=9,
        max_completion_tokens=11, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    sp = sampling_params(chat, chat.requested_max_tokens(), chat.num_logprobs())
    assert sp == SamplingParams(
        n=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.2, logit_bias={17: 5.0, 9: -100.0}, seed=123, stop=("x", "yz"), stop_token_ids=(4, 5),
        ignore_eos=True, min_new_tokens=2, max_new_tokens=11, logprobs=3,
    )  # fmt: skip
    comp = CompletionRequest(prompt="hi", stop="s", logprobs=0, max_tokens=4)
    sp = sampling_params(comp, comp.max_tokens, comp.num_logprobs())
    assert sp.stop == ("s",) and sp.logprobs == 0 and sp.max_new_tokens == 4 and sp.temperature == 1.0
    assert CompletionRequest(prompt="hi").max_tokens == 16  # OpenAI's default for completions


def test_chat_matches_engine_generate(engine, ref) -> None:
    body = dict(model=MODEL, messages=MSGS, n=2, max_completion_tokens=12, temperature=0.8, top_p=0.95, top_k=50,
                min_p=0.01, presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1,
                logit_bias={"100": 3.0}, seed=7, stop_token_ids=[5], ignore_eos=True, min_tokens=3, logprobs=True,
                top_logprobs=2)  # fmt: skip
    r = run(post(engine, "/v1/chat/completions", body))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == MODEL and out["id"].startswith("chatcmpl-")
    sp = SamplingParams(n=2, max_new_tokens=12, temperature=0.8, top_p=0.95, top_k=50, min_p=0.01,
                        presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={100: 3.0},
                        seed=7, stop_token_ids=[5], ignore_eos=True, min_new_tokens=3, logprobs=2)  # fmt: skip
    ids = chat_ids(ref)
    (expect,) = ref.generate([ids], sp, use_tqdm=False)
    assert len(out["choices"]) == 2
    for choice, exp in zip(out["choices"], expect.outputs):
        assert choice["message"] == {"role": "assistant", "content": exp.text}
        assert choice["finish_reason"] == exp.finish_reason
        content = choice["logprobs"]["content"]
        assert [c["logprob"] for c in content] == pytest.approx(exp.logprobs, abs=1e-4)
        assert all(len(c["top_logprobs"]) == 2 for c in content)
        assert "".join(c["token"] for c in content) == ref.tokenizer.decode(exp.token_ids)
    n_out = sum(len(o.token_ids) for o in expect.outputs)
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out,
                            "prompt_tokens_details": out["usage"]["prompt_tokens_details"]}  # fmt: skip
    assert_engine_drained(engine)


def test_streaming_equals_non_streaming_with_usage_last(engine) -> None:
    base = dict(model=MODEL, messages=MSGS, n=2, max_tokens=10, seed=3, ignore_eos=True)
    full = run(post(engine, "/v1/chat/completions", base)).json()
    r = run(post(engine, "/v1/chat/completions", {**base, "stream": True, "stream_options": {"include_usage": True}}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"]
    assert all("usage" not in e for e in events[:-1])
    for i in (0, 1):
        deltas = [c for e in events[:-1] for c in e["choices"] if c["index"] == i]
        assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in deltas) == full["choices"][i]["message"]["content"]
        finishes = [c["finish_reason"] for c in deltas]
        assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    no_usage = sse_events(run(post(engine, "/v1/chat/completions", {**base, "stream": True})).text)
    assert all(e["choices"] and "usage" not in e for e in no_usage)
    assert_engine_drained(engine)


def test_completions_echo_logprobs_and_token_prompts(engine, ref) -> None:
    prompt = [10, 200, 3000, 45]
    body = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    out = run(post(engine, "/v1/completions", body)).json()
    (exp,) = ref.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0, logprobs=3, ignore_eos=True),
                          use_tqdm=False)  # fmt: skip
    choice = out["choices"][0]
    assert out["object"] == "text_completion" and choice["text"] == exp.outputs[0].text
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == pytest.approx(exp.outputs[0].logprobs, abs=1e-4)
    assert len(lp["tokens"]) == 6 and all(len(t) == 3 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    echo = run(post(engine, "/v1/completions", {**body, "logprobs": None, "echo": True})).json()
    assert echo["choices"][0]["text"] == ref.tokenizer.decode(prompt) + exp.outputs[0].text
    stream = sse_events(run(post(engine, "/v1/completions", {**body, "logprobs": None, "echo": True, "stream": True,
                                                             "prompt": "Once upon"})).text)  # fmt: skip
    assert "".join(c["text"] for e in stream for c in e["choices"]).startswith("Once upon")
    streamed_lp = sse_events(run(post(engine, "/v1/completions", {**body, "stream": True})).text)
    assert sum((c["logprobs"]["token_logprobs"] for e in streamed_lp for c in e["choices"] if c["logprobs"]), []) \
        == pytest.approx(exp.outputs[0].logprobs, abs=1e-4)  # fmt: skip
    assert_engine_drained(engine)


def test_seed_reproducible_and_default_max_tokens(engine) -> None:
    body = dict(model=MODEL, prompt="The sky is", max_tokens=8, temperature=1.0, seed=99, ignore_eos=True)
    a, b = (run(post(engine, "/v1/completions", body)).json() for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    chat = run(post(engine, "/v1/chat/completions", dict(messages=MSGS, ignore_eos=True, temperature=0))).json()
    prompt = chat["usage"]["prompt_tokens"]  # no max_tokens: runs to the context limit; model may be omitted
    assert chat["usage"]["completion_tokens"] == engine.max_model_len - prompt
    assert chat["choices"][0]["finish_reason"] == "length"
    prompt = [7] * (engine.max_model_len - 4)  # exactly fits with 4 new tokens, not with 5
    fits = run(post(engine, "/v1/completions", dict(prompt=prompt, max_tokens=4, ignore_eos=True)))
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 4
    over = run(post(engine, "/v1/completions", dict(prompt=prompt, max_tokens=5)))
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"


TEXT = "Paris is lovely 😀 in spring, says the END of the story."


@pytest.mark.parametrize("stop", ["END of", "😀", "lovely 😀 in"])
def test_stream_stop_string_never_leaks(stop) -> None:
    llm = scripted_llm(TEXT, prompt_len=3)
    eng = AsyncLLMEngine(llm)
    with running(eng):
        body = dict(model=MODEL, prompt=[10, 11, 12], max_tokens=64, temperature=0, stop=[stop, "never"],
                    stream=True, stream_options={"include_usage": True})  # fmt: skip
        events = sse_events(run(post(eng, "/v1/completions", body)).text)
        pieces = [c["text"] for e in events for c in e["choices"]]
        expected = TEXT[: TEXT.index(stop)]
        assert "".join(pieces) == expected
        assert all("\ufffd" not in p for p in pieces)
        seen = ""
        for p in pieces:  # no chunk ever shows text beyond the final answer's prefix
            seen += p
            assert expected.startswith(seen)
        last = [c for e in events for c in e["choices"]][-1]
        assert last["finish_reason"] == "stop" and last["stop_reason"] == stop
        assert events[-1]["usage"]["completion_tokens"] > 0
        assert_engine_drained(eng)


ERRORS = [
    ("/v1/chat/completions", {"model": "gpt-4", "messages": MSGS}, "model"),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "objekt"}}}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}, "strictly": True}}}, "response_format.json_schema.strictly"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a("}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"xml": "x"}}, "structured_outputs.xml"),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_object"},
                              "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": MSGS, "tools": []}, "tools"),
    ("/v1/chat/completions", {"messages": MSGS, "temperature": 3}, "temperature"),
    ("/v1/chat/completions", {"messages": MSGS, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": MSGS, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": MSGS, "top_k": 0}, "top_k"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "min_tokens": 5}, "min_tokens"),
    ("/v1/chat/completions", {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSGS, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": MSGS, "logit_bias": {"10": 500}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": MSGS, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": MSGS, "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"messages": MSGS, "seed": -1}, "seed"),
    ("/v1/chat/completions", {"messages": MSGS, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]}, "messages"),
    ("/v1/chat/completions", {"messages": MSGS, "n": 100, "max_tokens": 400}, "n"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 500}, "max_tokens"),  # 500 + prompt > 512
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 5, "max_completion_tokens": 10**9},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 512}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**7]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
]


@pytest.mark.parametrize("path, body, param", ERRORS, ids=[e[2] + str(i) for i, e in enumerate(ERRORS)])
def test_bad_requests_get_400_naming_the_field(engine, path, body, param) -> None:
    r = run(post(engine, path, body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert engine.is_healthy()


def test_malformed_bodies(engine) -> None:
    async def go():
        async with http(engine) as c:
            for content in (b"{not json", b"[1, 2]", b'"text"'):
                r = await c.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
                assert r.status_code == 400 and "error" in r.json(), content
            ok = await c.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 2})
            assert ok.status_code == 200

    run(go())
    assert_engine_drained(engine)


SURROGATES = [  # JSON may escape a lone surrogate, which no tokenizer (or UTF-8 response) can take
    ("/v1/completions", '{"prompt": "ok \\udcff", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["\\ud800"], "max_tokens": 2}', "prompt[0]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\udfff"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", '{"prompt": "ok", "stop": ["x", "\\ud800"]}', "stop[1]"),
]


@pytest.mark.parametrize("path, raw, param", SURROGATES, ids=[s[2] for s in SURROGATES])
def test_lone_surrogates_get_400_naming_the_field(engine, path, raw, param) -> None:
    r = run(post_raw(engine, path, raw.encode()))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "UTF-8" in err["message"]
    assert_engine_drained(engine)


async def post_raw(engine, path: str, content: bytes):
    async with http(engine) as c:
        return await c.post(path, content=content, headers={"content-type": "application/json"})


def test_request_failing_while_running_gets_500_and_spares_the_others() -> None:
    """A row whose model output is invalid (NaN logits) fails alone: 500 (or an error event when
    streamed), while a concurrent request completes in full."""
    eng = AsyncLLMEngine(synthetic_llm(wrap=PoisonedModel))
    bad = {"prompt": [4, 5, PoisonedModel.POISON], "max_tokens": 5, "ignore_eos": True}
    # Greedy, and the poison token banned: the good request must never produce it itself (sampled at
    # the default temperature 1 it could, and then failed: seen once in a clean-clone run).
    good = {"prompt": [4, 5, 6], "max_tokens": 40, "ignore_eos": True, "temperature": 0,
            "logit_bias": {str(PoisonedModel.POISON): -100}}
    with running(eng):
        async def go():
            async with http(eng) as c:
                ok, failed, streamed = await asyncio.gather(
                    c.post("/v1/completions", json=good), c.post("/v1/completions", json=bad),
                    c.post("/v1/completions", json={**bad, "stream": True}))  # fmt: skip
                return ok, failed, streamed

        ok, failed, streamed = run(go())
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 40
        err = failed.json()["error"]
        assert failed.status_code == 500 and err["type"] == "server_error" and "invalid logits" in err["message"]
        datas = [line for line in streamed.text.split("\n") if line.startswith("data: ")]
        assert "invalid logits" in datas[-1] and "[DONE]" not in streamed.text
        assert eng.is_healthy()
        assert_engine_drained(eng)


def test_full_queue_gets_503_with_retry_after() -> None:
    eng = AsyncLLMEngine(synthetic_llm(), max_live_requests=1)
    with running(eng):
        async def go():
            async with http(eng) as c:
                long = asyncio.create_task(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 300, "ignore_eos": True}))
                for _ in range(500):
                    if eng._streams:
                        break
                    await asyncio.sleep(0.01)
                r = await c.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "overloaded"
                assert (await long).status_code == 200
                assert (await c.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})).status_code == 200

        run(go())
        assert_engine_drained(eng)


class PacedModel(torch.nn.Module):
    """Wraps a model; every forward takes at least 10 ms, so a long stream outlives any scheduling delay."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, *args):
        time.sleep(0.01)
        return self.inner(*args)


def test_shutdown_ends_streams_and_refuses_new_requests() -> None:
    # Paced: the 400-token stream takes >= 4 s, so it is still running when shutdown comes
    # even on a loaded machine (unpaced, it could finish first and end with [DONE]).
    eng = AsyncLLMEngine(synthetic_llm(wrap=PacedModel))
    eng.start()

    async def go():
        async with http(eng) as c:
            task = asyncio.create_task(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 400,
                                                                       "ignore_eos": True, "stream": True}))  # fmt: skip
            await async_wait_until(lambda: bool(eng._streams), what="the stream to start")
            await asyncio.to_thread(eng.shutdown)
            body = (await task).text
            assert "engine_unavailable" in body and "[DONE]" not in body
            r = await c.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
            assert r.status_code == 503
            assert (await c.get("/health")).status_code == 503

    run(go())
    llm = eng.llm
    assert not llm.has_unfinished_requests()
    llm.scheduler.check_invariants()

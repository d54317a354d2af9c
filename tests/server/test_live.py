"""`treeserve serve` as a real subprocess on a free 127.0.0.1 port, driven by the `openai` client.

The model is the seeded synthetic one written as a HF directory with the SmolLM2 tokenizer, so the
server starts in seconds. Every loop is bounded in count and time.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from treeserve.models import random_model, save_hf_dir, tiny_config

from ..engine._scripted import smol_tokenizer

openai = pytest.importorskip("openai")

NAME = "tiny-live"
MSGS = [{"role": "user", "content": "Say something."}]
NO_EOS = {"ignore_eos": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_dir(path: Path) -> Path:
    tok = smol_tokenizer()
    cfg = tiny_config("llama", vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids, max_position_embeddings=1024)
    save_hf_dir(random_model(cfg, seed=1, init_std=0.3), path)
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token}))  # fmt: skip
    return path


def _start_server(model: Path) -> tuple[subprocess.Popen, str]:
    """``python -m treeserve serve`` (how users run it) on a free port; returns once healthy."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "treeserve", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", NAME, "--dtype", "float32", "--threads", "1",
           "--kv-cache-tokens", "4096", "--max-running", "32", "--page-size", "4"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    _, err = proc.communicate()
    pytest.fail(f"server did not start: {err[-2000:]}")


def _stopped_cleanly(proc: subprocess.Popen, sig: int) -> str:
    """Send ``sig``; assert exit status 0 and no traceback; return stderr."""
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and f"serving {NAME!r} at http://127.0.0.1:" in err
    return err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("live-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    proc, base = _start_server(model_dir)
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _gauge(base: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", httpx.get(base + "/metrics", timeout=10).text, re.M)
    assert m is not None, name
    return float(m.group(1))


@pytest.mark.slow
def test_live_structured_output_with_openai_client(server, client) -> None:
    """``response_format`` (json_schema) and ``structured_outputs`` through the real client; a bad
    schema is a ``BadRequestError`` naming the field. Runs before the test that stops the server."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "word": {"type": "string", "enum": ["tea", "milk"]}},
              "required": ["n", "word"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "drink", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=40, n=2, seed=3, response_format=fmt)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    chunks = list(client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=40, seed=3, stream=True,
                                                 response_format=fmt))  # fmt: skip
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), schema)
    comp = client.completions.create(model=NAME, prompt="Pick:", max_tokens=10, seed=1,
                                     extra_body={"structured_outputs": {"choice": ["left", "right"]}})  # fmt: skip
    assert comp.choices[0].text in ("left", "right") and comp.choices[0].finish_reason == "stop"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=5, response_format=bad)
    assert err.value.status_code == 400 and err.value.body["param"] == "response_format"
    assert "objekt" in err.value.body["message"]
    assert server[0].poll() is None  # still serving


@pytest.mark.slow
def test_live_server_with_openai_client(server, client) -> None:
    proc, base = server
    assert [m.id for m in client.models.list().data] == [NAME]
    chat = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=8, temperature=0, extra_body=NO_EOS)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    comp = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert comp.usage.completion_tokens == 6 and comp.choices[0].text

    # streaming with usage, n=2
    chunks = list(client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=7, n=2, seed=5,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=NO_EOS))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    texts = ["".join(ch.delta.content or "" for c in chunks for ch in c.choices if ch.index == i) for i in (0, 1)]
    full = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=7, n=2, seed=5, extra_body=NO_EOS)
    assert texts == [c.message.content for c in full.choices]

    # seed reproducibility across calls
    a, b = (client.completions.create(model=NAME, prompt="The", max_tokens=10, temperature=1.0, seed=1234,
                                      extra_body=NO_EOS).choices[0].text for _ in range(2))  # fmt: skip
    assert a == b

    # a stop string that spans a token boundary
    lp = client.completions.create(model=NAME, prompt="Hello", max_tokens=12, temperature=0, logprobs=2,
                                   extra_body=NO_EOS).choices[0]  # fmt: skip
    tokens = lp.logprobs.tokens
    assert len(tokens) == 12 and all(len(t) == 2 for t in lp.logprobs.top_logprobs)
    k = next(i for i in range(2, 11) if tokens[i] and tokens[i + 1])
    stop = tokens[k][-1] + tokens[k + 1][:1]
    stopped = client.completions.create(model=NAME, prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                        extra_body=NO_EOS).choices[0]  # fmt: skip
    assert stopped.finish_reason == "stop" and stopped.text == lp.text[: lp.text.index(stop)]

    # chat logprobs
    lpc = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=4, logprobs=True, top_logprobs=3,
                                         extra_body=NO_EOS).choices[0].logprobs.content  # fmt: skip
    assert len(lpc) == 4 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lpc)

    # a bad request
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=NAME, messages=MSGS, temperature=7)
    assert exc.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="not-this-one", messages=MSGS)

    # 20 dropped streams, then KV usage back to its baseline
    baseline = _gauge(base, "vllm:kv_cache_usage_perc")
    for _ in range(20):
        stream = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=500, stream=True, extra_body=NO_EOS)
        next(iter(stream))
        stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_gauge(base, "vllm:kv_cache_usage_perc") > baseline
                                            or _gauge(base, "vllm:num_requests_running") > 0):  # fmt: skip
        time.sleep(0.1)
    assert _gauge(base, "vllm:kv_cache_usage_perc") == baseline == 0.0
    assert _gauge(base, "vllm:num_requests_running") == 0 and _gauge(base, "vllm:num_requests_waiting") == 0
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=2).choices

    # Ctrl-C twice with a stream in flight: aborted at once (an error event ends the stream, not a
    # cut connection), exit 0, no traceback (uvicorn's force exit would log cancelled handlers)
    body = {"model": NAME, "messages": MSGS, "max_tokens": 500, "stream": True, **NO_EOS}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        last = [line for line in lines if line.startswith("data: ")][-1]
        assert time.monotonic() - t0 < 2.0  # not the 2.5 s grace period of a single signal
    assert "engine_unavailable" in last
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]


@pytest.mark.slow
def test_sigterm_with_a_non_streaming_request_in_flight(model_dir) -> None:
    """SIGTERM while a long non-streaming request runs: it finishes or gets a clean 503 (never a
    dropped connection), and the process exits 0 without a traceback."""
    proc, base = _start_server(model_dir)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            body = {"model": NAME, "prompt": "Once", "max_tokens": 1000, "ignore_eos": True}
            pending = pool.submit(httpx.post, base + "/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _gauge(base, "vllm:num_requests_running") < 1:
                time.sleep(0.05)
            assert _gauge(base, "vllm:num_requests_running") == 1
            _stopped_cleanly(proc, signal.SIGTERM)
            r = pending.result(timeout=60)
        if r.status_code == 200:  # finished within the grace period
            assert r.json()["usage"]["completion_tokens"] == 1000 and r.json()["choices"][0]["finish_reason"] == "length"
        else:
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

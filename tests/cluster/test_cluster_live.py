"""Two engine replicas on a local Ray cluster (``ray.init(num_cpus=2)``, 1 thread each) behind the
OpenAI app, driven over 127.0.0.1 by the real ``openai`` client.

One cluster for the module (Ray start-up is the cost): the ingress runs in this process under
uvicorn on a free port, as ``treeserve serve --replicas 2`` runs it. Every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
from pathlib import Path

import httpx
import pytest

import ray  # the "cluster" extra, which `make test` installs: no skip without it
openai = pytest.importorskip("openai")

import uvicorn  # noqa: E402
from ray import serve  # noqa: E402

from treeserve.cluster.client import REPLICA_DIED, ClusterEngineClient  # noqa: E402
from treeserve.cluster.launch import APP_NAME, DEPLOYMENT_NAME, deploy  # noqa: E402
from treeserve.cluster.router import replica_stats, route_counts  # noqa: E402
from treeserve.server.api import build_app  # noqa: E402

from ..server._helpers import wait_until  # noqa: E402
from ..server.test_live import _free_port, _model_dir  # noqa: E402
from ..server.test_live import _gauge as _metric  # noqa: E402

NAME = "tiny-cluster"
NO_EOS = {"ignore_eos": True}


def _replica_actors() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#"))  # fmt: skip


def _running_replicas() -> int:
    st = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
    return st.replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(base URL, ingress client) over 2 replicas; Ray and Serve are shut down afterwards."""
    model = _model_dir(tmp_path_factory.mktemp("cluster-model"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TREESERVE_DEBUG_CHECKS": "1"}})  # fmt: skip
    server = None
    try:
        serve.start(proxy_location="Disabled")
        kw = dict(model=str(model), dtype="float32", kv_cache_tokens=4096, page_size=4, max_running=32)
        handle = deploy(kw, replicas=2, threads=1, max_live_requests=256, served_model_name=NAME)
        client = ClusterEngineClient(handle, handle.engine_info.remote().result(), max_live_requests=256)
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(build_app(client, NAME), host="127.0.0.1", port=port,
                                               log_level="warning"))  # fmt: skip
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_until(lambda: server.started, 30, what="uvicorn")
        yield f"http://127.0.0.1:{port}", client
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(timeout=30)
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=cluster[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_streaming_and_not(cluster, oai) -> None:
    assert [m.id for m in oai.models.list().data] == [NAME]
    chat = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       temperature=0, extra_body=NO_EOS)  # fmt: skip
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
    again = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                        temperature=0, extra_body=NO_EOS)  # fmt: skip
    assert again.choices[0].message.content == chat.choices[0].message.content  # greedy: same on either replica
    chunks = list(oai.completions.create(model=NAME, prompt="Once upon a time", max_tokens=6, temperature=0,
                                         stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    whole = oai.completions.create(model=NAME, prompt="Once upon a time", max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    n2 = oai.completions.create(model=NAME, prompt="Tea", max_tokens=4, n=2, seed=5, extra_body=NO_EOS)
    assert sorted(c.index for c in n2.choices) == [0, 1] and n2.usage.completion_tokens == 8
    assert httpx.get(cluster[0] + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": 4, "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": 4, "tools": []}, "tools"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ({"prompt": [10**9], "max_tokens": 4}, "prompt"),
    ({"prompt": "x", "max_tokens": 4, "model": "other"}, "model"),
])  # fmt: skip
def test_bad_input_gets_the_single_servers_400(cluster, body, param) -> None:
    r = httpx.post(cluster[0] + "/v1/completions", json={"model": NAME, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_engine_refusal_is_a_400_from_the_replica(cluster) -> None:
    """A prompt as long as the context passes the ingress's checks; the replica's engine refuses
    it (``Refused``), which must come back as the single server's 400, not a 5xx."""
    r = httpx.post(cluster[0] + "/v1/completions", json={"model": NAME, "prompt": [5] * 1024, "max_tokens": 1},
                   timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_routing_affinity_keeps_each_prefix_on_one_replica(cluster, oai) -> None:
    """3 system prompts x 4 users, sequential: after each prompt's first request every request
    must find its prefix cached on the replica it was routed to (round robin would miss half)."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    systems = [" ".join(words[(i * 7 + k) % 10] + str(k % 13) for k in range(90)) for i in range(3)]
    hits = prompt = 0
    for user in range(4):
        for s, system in enumerate(systems):
            r = oai.completions.create(model=NAME, prompt=f"{system}\nUser {user} asks {s}:", max_tokens=2,
                                       extra_body=NO_EOS)  # fmt: skip
            if user:
                hits += r.usage.prompt_tokens_details.cached_tokens
                prompt += r.usage.prompt_tokens
    rate = hits / prompt
    routes = route_counts(DEPLOYMENT_NAME)
    print(f"\naffinity: prefix hit rate {rate:.3f} over {prompt} prompt tokens (requests after the first per prefix); "
          f"routes {routes}")  # fmt: skip
    assert rate > 0.85
    assert routes["prefix"] >= 9 and routes["balance"] == 0


def test_metrics_sum_the_replicas(cluster, oai) -> None:
    oai.completions.create(model=NAME, prompt="Count", max_tokens=3, extra_body=NO_EOS)
    wait_until(lambda: len(replica_stats(DEPLOYMENT_NAME)) == 2 and all(s.get("steps", 0) > 0 for s in
          replica_stats(DEPLOYMENT_NAME).values()), 30, what="both replicas' routing stats")  # fmt: skip
    steps = sum(s["steps"] for s in replica_stats(DEPLOYMENT_NAME).values())
    assert _metric(cluster[0], "treeserve:engine_steps_total") >= steps > 0
    assert _metric(cluster[0], "vllm:prefix_cache_queries_total") > 0


def test_disconnected_stream_is_aborted_on_its_replica(cluster) -> None:
    body = {"model": NAME, "prompt": "Go on", "max_tokens": 400, "stream": True, **NO_EOS}
    with httpx.stream("POST", cluster[0] + "/v1/completions", json=body, timeout=30) as r:
        next(r.iter_lines())
    # the replica's engine drains: nothing running anywhere once the abort reached it
    wait_until(lambda: _metric(cluster[0], "vllm:num_requests_running") == 0, 30, what="the aborted request to leave")
    assert not cluster[1]._streams


@pytest.mark.slow
def test_killed_replica_mid_load(cluster, oai) -> None:
    """Kill one replica while 6 streams run: its streams end with the replica-died error (503
    event), the others finish, new requests are served meanwhile, and Ray Serve starts a new one."""
    def stream(i: int) -> tuple[str, str | None]:
        finish = None
        try:
            for c in oai.completions.create(model=NAME, prompt=f"Story {i}:", max_tokens=400, stream=True,
                                            extra_body=NO_EOS):  # fmt: skip
                finish = c.choices[0].finish_reason if c.choices else finish
            return "done", finish
        except openai.APIError as exc:
            return str(exc), finish

    before = _replica_actors()
    assert len(before) == 2
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(stream, i) for i in range(6)]
        wait_until(lambda: _metric(cluster[0], "vllm:num_requests_running") >= 4, 60, what="the streams to run")

        def running() -> dict[str, int]:
            return {rid: st.get("num_running", 0) for rid, st in replica_stats(DEPLOYMENT_NAME).items()}

        last: dict[str, int] = {}

        def spread() -> bool:  # the burst runs on both replicas
            last.clear()
            last.update(running())
            return len(last) == 2 and min(last.values()) >= 1 and sum(last.values()) >= 4

        # each replica reports its stats on its own 1 s period (later on a loaded host): one
        # snapshot can hold one replica's new stats beside the other's from before the burst
        try:
            wait_until(spread, 30, what="the replicas' routing stats to show the burst on both")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last stats: {last}") from None
        now = dict(last)
        busy = max(now, key=now.__getitem__)
        victim = next(name for name in before if name.endswith(f"#{busy}"))
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        ok = oai.completions.create(model=NAME, prompt="Still there?", max_tokens=4, extra_body=NO_EOS)
        assert ok.choices[0].finish_reason == "length"
        results = [f.result(timeout=120) for f in futs]
    done = [r for r in results if r[0] == "done"]
    died = [r for r in results if r[0] != "done"]
    assert done and all(finish == "length" for _, finish in done), results
    assert died and all("replica serving this request died" in msg and finish is None for msg, finish in died), results
    assert REPLICA_DIED.startswith("unavailable")
    wait_until(lambda: _running_replicas() == 2 and len(_replica_actors()) == 2, 180, what="Ray Serve to replace the replica")
    assert set(_replica_actors()) != set(before)
    r = oai.completions.create(model=NAME, prompt="Back", max_tokens=3, extra_body=NO_EOS)
    assert r.usage.completion_tokens == 3

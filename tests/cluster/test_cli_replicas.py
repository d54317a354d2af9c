"""``treeserve serve --replicas 2`` as users run it: a subprocess owning a local Ray cluster, asked
over HTTP by the ``openai`` client, then stopped with Ctrl-C (SIGINT to its whole process group, as
a terminal sends it). It must exit 0 and leave no process behind: every process seen in its tree
while serving, and everything in its session, is gone afterwards (bounded waits)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import ray  # noqa: F401  (the "cluster" extra, which `make test` installs: no skip without it)
openai = pytest.importorskip("openai")

from ..server.test_live import _free_port, _model_dir  # noqa: E402


def _procs() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, session id, state) of every live process."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(d.name)] = (int(fields[1]), int(fields[3]), fields[0])
    return out


def _tree(root: int) -> set[int]:
    procs = _procs()
    found, todo = {root}, [root]
    while todo:
        p = todo.pop()
        kids = {c for c, (pp, _, _) in procs.items() if pp == p} - found
        found |= kids
        todo += kids
    return found


def _alive(pids: set[int], session: int) -> set[int]:
    return {p for p, (_, sid, state) in _procs().items() if state != "Z" and (p in pids or sid == session)}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_replicas_serve_and_ctrl_c_leaves_no_ray_process(tmp_path) -> None:
    model = _model_dir(tmp_path / "model")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "treeserve", "serve", "--model", str(model), "--replicas", "2", "--threads", "1",
           "--port", str(port), "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-tokens", "4096",
           "--page-size", "4"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail(f"server did not start: {proc.communicate(timeout=30)[0][-3000:]}")
        oai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert r.usage.completion_tokens == 4
        tree = _tree(proc.pid)
        assert len(tree) >= 5, f"expected the Ray processes under the server, found {tree}"  # gcs, raylet, replicas...
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=90)[0]
        assert proc.returncode == 0, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        deadline = time.monotonic() + 30
        while _alive(tree, proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _alive(tree, proc.pid)
        assert not left, [Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:120] for p in left]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()

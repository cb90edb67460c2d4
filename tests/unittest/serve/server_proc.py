"""`trtllm-serve` in a subprocess on a free port (start, health wait, stop) and its /metrics as a dict."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

import tensorrt_llm

REPO_ROOT = Path(tensorrt_llm.__file__).resolve().parent.parent
# tiny model: a KV pool (320 tokens) smaller than max_seq_len (512), so a request can be refused for
# the pool alone; still room for several requests of the tests at once
TINY_ARGS = {"device": "cpu", "kv_cache_config": {"max_tokens": 320, "tokens_per_block": 16}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base_url: str           # http://127.0.0.1:PORT
    model: str              # the served model id
    proc: subprocess.Popen
    log: Path

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed `name{label="v",...}` (labels sorted)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


def cli_env() -> dict:
    """The environment of a `tensorrt_llm.serve.cli` subprocess (this checkout first on the path)."""
    return {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def spawn_cli(argv: list[str], log: Path) -> subprocess.Popen:
    """`python -m tensorrt_llm.serve.cli ARGV` with its output in `log`."""
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "tensorrt_llm.serve.cli", *argv],
                                stdout=f, stderr=subprocess.STDOUT, env=cli_env(), cwd=REPO_ROOT)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 180.0) -> None:
    """Until `url`/health answers 200; RuntimeError with the log's tail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


def start_server(model: Path, args: dict, tmp: Path, timeout: float = 180.0) -> Server:
    cfg = tmp / "serve.yaml"
    cfg.write_text(yaml.safe_dump(args))
    port = free_port()
    log = tmp / "server.log"
    proc = spawn_cli([str(model), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
                      "--log_level", "warning"], log)
    server = Server(f"http://127.0.0.1:{port}", str(model), proc, log)
    try:
        wait_healthy(proc, server.base_url, log, timeout)
    except RuntimeError:
        stop_server(server)
        raise
    return server


def stop_server(server: Server) -> Optional[int]:
    server.proc.terminate()
    try:
        return server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        return server.proc.wait()

"""Request latency of ``neuron-tp serve`` (tp=1) under concurrent clients.

Starts the server per device (``--device cpu``: eager torch; ``--device xla``: replayed
graphs on the XLA CPU device), then for each concurrency N: N clients (threads, the ``openai``
client, streaming) each send K completions of ``--max-tokens`` tokens (greedy). Reports p50/p99
request latency, p50/p99 TTFT (first streamed chunk) and completion tokens/s over the run
(counted by the server: ``stream_options.include_usage``). The server captures every graph
shape before it is ready (``--warmup all``) and one untimed round per N runs first.

Usage: ``PJRT_DEVICE=CPU python benchmarks/serve_latency.py [--devices cpu,xla]
[--clients 1,4,8] [--requests 8] [--max-tokens 32]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time", "Tensor parallel"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(device: str, args) -> tuple[subprocess.Popen, str]:
    """A tp=1 server on a free port, once ready (its output in a temporary file)."""
    port = _free_port()
    cmd = [
        sys.executable, "-m", "neuron_tp.cli", "serve", "--model", args.model, "--device", device,
        "--port", str(port), "--buckets", "32", "--batch-buckets", args.batch_buckets,
        "--max-new-tokens", str(args.max_tokens), "--warmup", "all",
    ]  # fmt: skip
    log = tempfile.NamedTemporaryFile("w+", prefix=f"serve-{device}-", suffix=".log", delete=False)
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the {device} server did not get ready; see {log.name}")


def one_request(client, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(latency s, TTFT s, completion tokens) of one streamed greedy completion."""
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    stream = client.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return time.perf_counter() - t0, ttft or 0.0, tokens


def run_clients(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    """Every client sends ``requests`` completions back to back, all clients at once (timed
    from when every client is set up)."""
    import openai

    results: list[tuple[float, float, int]] = []
    lock, start = threading.Lock(), threading.Barrier(clients + 1)

    def client(c: int) -> None:
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        start.wait()
        for k in range(requests):
            r = one_request(api, PROMPTS[(c + k) % len(PROMPTS)], max_tokens)
            with lock:
                results.append(r)

    with ThreadPoolExecutor(clients) as pool:
        done = pool.map(client, range(clients))
        start.wait()
        t0 = time.perf_counter()
        list(done)
    wall = time.perf_counter() - t0
    lat = sorted(r[0] for r in results)
    ttft = sorted(r[1] for r in results)
    return {
        "p50": _pct(lat, 50),
        "p99": _pct(lat, 99),
        "ttft50": _pct(ttft, 50),
        "ttft99": _pct(ttft, 99),
        "tok_s": sum(r[2] for r in results) / wall,
        "req_s": len(results) / wall,
    }


def _pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="cpu,xla")
    p.add_argument("--clients", default="1,4,8")
    p.add_argument("--requests", type=int, default=8, help="per client")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch-buckets", default="1,2,4,8")
    p.add_argument("--model", default="tiny-llama")
    args = p.parse_args()
    rows = []
    for device in args.devices.split(","):
        proc, url = start_server(device, args)
        try:
            for n in map(int, args.clients.split(",")):
                run_clients(url, n, 1, args.max_tokens)  # warm-up: this batch size's graphs
                rows.append((device, n, run_clients(url, n, args.requests, args.max_tokens)))
        finally:
            proc.terminate()
            proc.wait(60)
    print(
        f"{'device':6} {'clients':>7} {'p50 ms':>8} {'p99 ms':>8} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'tokens/s':>9} {'req/s':>7}"
    )
    for device, n, r in rows:
        print(
            f"{device:6} {n:7d} {r['p50'] * 1e3:8.1f} {r['p99'] * 1e3:8.1f} "
            f"{r['ttft50'] * 1e3:9.1f} {r['ttft99'] * 1e3:9.1f} {r['tok_s']:9.1f} "
            f"{r['req_s']:7.2f}"
        )


if __name__ == "__main__":
    main()

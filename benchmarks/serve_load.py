"""``neuron-tp serve`` under load: static batching (the engine before continuous batching, run
from a git checkout of ``--baseline``) vs this tree's continuous batching, in the same run, on
the XLA CPU device with an 8-layer tiny Llama (replayed graphs, ``--warmup all``).

Scenarios (greedy, streamed, the ``openai`` client):
1. short alone: a short request (``--short`` tokens) with nothing else running; median latency;
2. short under load: the same short requests while ``--long-clients`` clients stream long
   completions (``--long`` tokens) back to back; median latency and its ratio to (1) (the goal
   of continuous batching: <= 3x; a static batch makes the short one wait for the long ones);
3. mixed: ``--clients`` clients each sending ``--requests`` completions of random lengths
   (``--short`` .. ``--long``); completion tokens/s, p50/p99 latency, p50/p99 TTFT.

Usage: ``python benchmarks/serve_load.py [--baseline 8bb112a] [--layers 8]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_latency import _free_port, _pct, one_request  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = "8bb112a"  # main's last commit with the static (batch-at-a-time) engine


def save_model(path: str, layers: int) -> None:
    """A tiny Llama (hidden 64, ``layers`` layers, byte vocabulary) saved to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=257,
        max_position_embeddings=1024,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)


def start(tree: str, model: str, args, log_dir: str) -> tuple[subprocess.Popen, str]:
    """A tp=1 server of the code in ``tree`` on the XLA CPU device, once ready."""
    import urllib.request

    port = _free_port()
    cmd = [
        sys.executable, "-m", "neuron_tp.cli", "serve", "--model", model, "--tokenizer", "bytes",
        "--port", str(port), "--served-model-name", "m", "--buckets", "16,64",
        "--batch-buckets", args.batch_buckets,
        "--max-new-tokens", str(args.long), "--warmup", "all",
    ]  # fmt: skip
    log = open(os.path.join(log_dir, f"serve-{os.path.basename(tree)}.log"), "w")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": tree}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tree, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server of {tree} did not get ready; see {log.name}")


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)


def short_latency(url: str, n: int, tokens: int) -> list[float]:
    api = _client(url)
    return [one_request(api, "Hi", tokens)[0] for _ in range(n)]


def under_load(url: str, args) -> list[float]:
    """Short requests while ``args.long_clients`` clients stream long ones back to back."""
    stop = threading.Event()

    def long_client(c: int) -> None:
        api = _client(url)
        while not stop.is_set():
            one_request(api, f"Once upon a time {c}", args.long)

    with ThreadPoolExecutor(args.long_clients) as pool:
        futures = [pool.submit(long_client, c) for c in range(args.long_clients)]
        time.sleep(1.0)  # the long ones are running
        lat = short_latency(url, args.samples, args.short)
        stop.set()
        for f in futures:
            f.result()
    return lat


def mixed(url: str, args) -> dict:
    rng = random.Random(0)
    plan = [
        [rng.randint(args.short, args.long) for _ in range(args.requests)]
        for _ in range(args.clients)
    ]
    results, lock = [], threading.Lock()
    barrier = threading.Barrier(args.clients + 1)

    def client(c: int) -> None:
        api = _client(url)
        barrier.wait()
        for n in plan[c]:
            r = one_request(api, f"Tensor {c}", n)
            with lock:
                results.append(r)

    with ThreadPoolExecutor(args.clients) as pool:
        done = pool.map(client, range(args.clients))
        barrier.wait()
        t0 = time.perf_counter()
        list(done)
    wall = time.perf_counter() - t0
    lat, ttft = sorted(r[0] for r in results), sorted(r[1] for r in results)
    return {
        "tok_s": sum(r[2] for r in results) / wall,
        "p50": _pct(lat, 50),
        "p99": _pct(lat, 99),
        "ttft50": _pct(ttft, 50),
        "ttft99": _pct(ttft, 99),
    }


def measure(tree: str, model: str, args, log_dir: str) -> dict:
    proc, url = start(tree, model, args, log_dir)
    try:
        short_latency(url, 2, args.short)  # warm the HTTP path
        alone = statistics.median(short_latency(url, args.samples, args.short))
        loaded = statistics.median(under_load(url, args))
        return {"alone": alone, "loaded": loaded, **mixed(url, args)}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default=BASELINE, help="git ref of the static engine")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch-buckets", default="1,2,4,8")
    p.add_argument("--short", type=int, default=8, help="tokens of a short request")
    p.add_argument("--long", type=int, default=256, help="tokens of a long request")
    p.add_argument("--long-clients", type=int, default=4)
    p.add_argument("--samples", type=int, default=10, help="short requests timed per scenario")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=4, help="per client in the mixed scenario")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        model = os.path.join(tmp, "model")
        save_model(model, args.layers)
        base = os.path.join(tmp, "static")
        subprocess.run(["git", "worktree", "add", "-q", "--detach", base, args.baseline],
                       cwd=REPO, check=True)  # fmt: skip
        try:
            rows = [
                (f"static ({args.baseline})", measure(base, model, args, tmp)),
                ("continuous (this tree)", measure(REPO, model, args, tmp)),
            ]
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", base], cwd=REPO, check=False)
    print(
        f"{args.layers}-layer tiny Llama, XLA CPU device, slots/batch {args.batch_buckets}; "
        f"short = {args.short} tokens, long = {args.long}; mixed = {args.clients} clients x "
        f"{args.requests} requests of {args.short}..{args.long} tokens"
    )
    print(
        f"{'engine':26} {'short alone':>11} {'short+load':>11} {'ratio':>6} {'mixed tok/s':>11} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'TTFT p50':>9} {'TTFT p99':>9}"
    )
    for name, r in rows:
        print(
            f"{name:26} {r['alone'] * 1e3:9.1f}ms {r['loaded'] * 1e3:9.1f}ms "
            f"{r['loaded'] / r['alone']:6.1f} {r['tok_s']:11.1f} {r['p50'] * 1e3:8.0f} "
            f"{r['p99'] * 1e3:8.0f} {r['ttft50'] * 1e3:9.1f} {r['ttft99'] * 1e3:9.1f}"
        )


if __name__ == "__main__":
    main()

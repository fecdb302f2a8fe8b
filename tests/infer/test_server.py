"""``neuron-tp serve`` with the real ``openai`` client: completions and chat equal what
:class:`neuron_tp.infer.generate.Generator` gives directly (greedy and seeded sampling),
streaming, stop strings, concurrent clients, a client that disconnects mid-stream, refused
requests; at tp=1 in this process and at tp=2 as two torchrun ranks (gloo), whose tokens
equal tp=1's (same preset and seed: the same full model, sharded). Also
:func:`neuron_tp.parallel.comm.host_broadcast` on two gloo ranks."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import gloo_dist
from neuron_tp.infer.generate import GREEDY, Generator, Sampling
from neuron_tp.infer.server import chat_prompt

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTIONS = {
    "model": "tiny-llama",
    "seed": 3,
    "buckets": [16, 32],
    "batch_buckets": [1, 2, 4],
    "max_new_tokens": 24,
}
PROMPTS = ["Hello", "The cat", "Once upon", "abc", "xyz!", "Hi there", "Tensor", "A"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(port: int, tp: int = 1):
    from neuron_tp.job.config import ServeConfig

    o = OPTIONS
    return ServeConfig(
        model=o["model"],
        tp=tp,
        device="cpu",
        tokenizer=None,
        seed=o["seed"],
        xla_cpu_devices=0,
        host="127.0.0.1",
        port=port,
        max_new_tokens=o["max_new_tokens"],
        buckets=o["buckets"],
        batch_buckets=o["batch_buckets"],
        batch_wait_ms=5.0,
        dtype="float32",
        served_model_name="tiny",
        warmup="smallest",
    )


class Reference:
    """Texts straight from a Generator on a copy of the tp=1 model (one prompt per call; a
    copy: the server's worker may run the model at the same time, and a parallelized model's
    forward is not re-entrant across threads)."""

    def __init__(self, model, tok, eos):
        model = copy.deepcopy(model)
        self.gen = Generator(model, OPTIONS["buckets"], OPTIONS["max_new_tokens"], [1], 0)
        self.tok, self.eos, self.lock = tok, eos, threading.Lock()

    def tokens(self, ids: list[int], n: int, sampling: Sampling = GREEDY) -> list[int]:
        with self.lock:
            return self.gen.generate([ids], n, sampling, self.eos)[0]

    def text(self, prompt: str, n: int, sampling: Sampling = GREEDY, chat=False) -> str:
        if chat:
            prompt = chat_prompt(self.tok, [{"role": "user", "content": prompt}])
        out = self.tokens(self.tok.encode(prompt), n, sampling)
        return self.tok.decode([t for t in out if t not in self.eos])


@pytest.fixture(scope="module")
def tp1():
    """(engine, reference, base url) of an in-process tp=1 server on a free port."""
    import uvicorn

    from neuron_tp import init_mesh
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.server import _load, create_app

    config = _config(_free_port())
    mesh = init_mesh(tp=1)
    engine = Engine()
    _load(engine, config, mesh)
    engine.start()
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, "tiny"), "127.0.0.1", config.port, log_level="error")
    )
    http = threading.Thread(target=server.run, daemon=True)
    http.start()
    while not server.started:
        time.sleep(0.02)
    ref = Reference(engine.gen.model, engine.tokenizer, engine.eos_ids)
    yield engine, ref, f"http://127.0.0.1:{config.port}"
    server.should_exit = True
    http.join(10)
    engine.shutdown(10)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _complete(client, prompt, n=8, **kw):
    kw.setdefault("temperature", 0)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=n, **kw)


def _chat(client, text, n=8, **kw):
    kw.setdefault("temperature", 0)
    messages = [{"role": "user", "content": text}]
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=n, **kw)


def _streamed(stream, chat: bool, usage: list | None = None) -> tuple[str, str | None]:
    """The concatenated deltas and the finish reason (the usage chunk into ``usage``)."""
    text, reason = "", None
    for chunk in stream:
        if not chunk.choices and usage is not None:
            usage.append(chunk.usage)
            continue
        (choice,) = chunk.choices
        text += (choice.delta.content or "") if chat else choice.text
        reason = choice.finish_reason or reason
    return text, reason


# -- tp=1, in-process ------------------------------------------------------------------------


def test_health_ready_and_models(tp1):
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.server import create_app

    _, _, url = tp1
    assert _get(url + "/health") == (200, {"status": "ok"})
    assert _get(url + "/ready")[0] == 200
    assert [m.id for m in _client(url).models.list()] == ["tiny"]
    # an app whose model is still loading: live, not ready, refuses work with 503
    from starlette.testclient import TestClient

    with TestClient(create_app(Engine(), "tiny")) as c:
        assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "not ready" in r.json()["error"]["message"]


def test_completions_and_chat_equal_the_generator(tp1):
    _, ref, url = tp1
    client = _client(url)
    r = _complete(client, "Hello", 10)
    assert r.choices[0].text == ref.text("Hello", 10)
    assert r.usage.prompt_tokens == 5 and r.usage.total_tokens == 5 + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 10
    multi = _complete(client, ["The cat", "abc"], 6)
    assert [c.text for c in multi.choices] == [ref.text("The cat", 6), ref.text("abc", 6)]
    seeded = Sampling(True, 0.8, 20, 7)
    r = _complete(client, "Once upon", 12, temperature=0.8, seed=7, extra_body={"top_k": 20})
    assert r.choices[0].text == ref.text("Once upon", 12, seeded)
    c = _chat(client, "hi", 10)
    assert c.choices[0].message.content == ref.text("hi", 10, chat=True)
    assert c.choices[0].message.role == "assistant"
    c = _chat(client, "hi", 10, temperature=1.5, seed=11)
    assert c.choices[0].message.content == ref.text("hi", 10, Sampling(True, 1.5, 0, 11), True)


def test_streaming_equals_non_streaming(tp1):
    _, ref, url = tp1
    client = _client(url)
    for chat in (False, True):
        call = _chat if chat else _complete
        whole = call(client, "Tensor", 16)
        usage: list = []
        stream = call(client, "Tensor", 16, stream=True, stream_options={"include_usage": True})
        text, reason = _streamed(stream, chat, usage)
        expected = whole.choices[0].message.content if chat else whole.choices[0].text
        assert text == expected == ref.text("Tensor", 16, chat=chat)
        assert reason == whole.choices[0].finish_reason
        assert [u.completion_tokens for u in usage] == [whole.usage.completion_tokens]


def test_stop_strings_cut_the_text(tp1):
    _, ref, url = tp1
    full = ref.text("Hello", 16)
    k = next(i for i in range(2, len(full)) if full[i] != "\ufffd")
    stop = full[k]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        r = _complete(_client(url), "Hello", 16, stop=[stop, "never-there"], stream=stream)
        text, reason = _streamed(r, False) if stream else (r.choices[0].text, None)
        assert text == expected
        assert (reason if stream else r.choices[0].finish_reason) == "stop"


def test_concurrent_clients_get_their_own_answers(tp1):
    engine, ref, url = tp1
    lengths = [3 + i % 6 for i in range(len(PROMPTS))]
    expected = [ref.text(p, n) for p, n in zip(PROMPTS, lengths)]
    before = engine.stats["max_batch"]
    barrier = threading.Barrier(len(PROMPTS))

    def ask(i: int) -> str:
        client = _client(url)
        barrier.wait()
        if i % 2:
            return _streamed(_complete(client, PROMPTS[i], lengths[i], stream=True), False)[0]
        return _complete(client, PROMPTS[i], lengths[i]).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, range(len(PROMPTS))))
    assert got == expected
    assert max(before, engine.stats["max_batch"]) > 1, "concurrent requests were never batched"


def test_client_disconnect_mid_stream(tp1):
    engine, ref, url = tp1
    cancelled = engine.stats["cancelled"]
    client = _client(url)
    long = _complete(client, "Hello", OPTIONS["max_new_tokens"], stream=True)
    other = ThreadPoolExecutor(1).submit(lambda: _complete(_client(url), "abc", 8).choices[0].text)
    chunks = iter(long)
    next(chunks), next(chunks)
    long.close()  # the client goes away after 2 chunks
    assert other.result(60) == ref.text("abc", 8)
    assert _get(url + "/health")[0] == 200
    assert _complete(client, "The cat", 6).choices[0].text == ref.text("The cat", 6)
    deadline = time.monotonic() + 10
    while engine.stats["cancelled"] == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats["cancelled"] > cancelled, "the disconnected stream kept its slot"
    assert engine.slots_in_use() == 0


BAD = [
    ({"prompt": "x" * 60}, "prompt of 60 tokens + max_tokens 4 exceeds the 56 positions"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature must be >= 0"),
    ({"prompt": "hi", "n": 2}, "n must be 1"),
    ({"prompt": "hi", "max_tokens": 1000}, "max_tokens must be in 1..24"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": 5}, "prompt must be a string"),
    ({"messages": []}, "messages must be"),
]


def test_bad_requests_get_400_and_the_server_goes_on(tp1):
    _, ref, url = tp1
    client = _client(url)
    for body, message in BAD:
        kind = client.chat.completions if "messages" in body else client.completions
        body.setdefault("max_tokens", 4)
        with pytest.raises(openai.BadRequestError) as err:
            kind.create(model="tiny", **body)
        assert err.value.status_code == 400
        assert message in err.value.body["message"], err.value.body
        assert err.value.body["type"] == "invalid_request_error"
    assert _complete(client, "Hello", 6).choices[0].text == ref.text("Hello", 6)


def test_unknown_model_gets_404_model_not_found(tp1):
    _, ref, url = tp1
    client = _client(url)
    (listed,) = [m.id for m in client.models.list()]
    for call in (
        lambda m: client.completions.create(model=m, prompt="Hello", max_tokens=4),
        lambda m: client.chat.completions.create(
            model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        ),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            call("gpt-4o")
        assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"
        assert "'gpt-4o'" in err.value.body["message"] and repr(listed) in err.value.body["message"]
        assert call(listed).model == listed  # the listed id is accepted
    assert _complete(client, "Hello", 6).choices[0].text == ref.text("Hello", 6)


def test_logprobs_are_refused_not_silently_null(tp1):
    _, _, url = tp1
    client = _client(url)
    asks = [
        (lambda: _complete(client, "Hello", 4, logprobs=2), "logprobs"),
        (lambda: _complete(client, "Hello", 4, logprobs=0), "logprobs"),
        (lambda: _chat(client, "hi", 4, logprobs=True), "logprobs"),
        (lambda: _chat(client, "hi", 4, top_logprobs=3), "top_logprobs"),
    ]
    for ask, name in asks:
        with pytest.raises(openai.BadRequestError) as err:
            ask()
        assert err.value.body["param"] == name
        assert f"{name} is not supported" in err.value.body["message"], err.value.body
    assert _chat(client, "hi", 4, logprobs=False).choices[0].message.content  # off: fine


def test_chat_content_as_text_parts(tp1):
    _, ref, url = tp1
    client = _client(url)

    def chat(content, n=8):
        messages = [{"role": "user", "content": content}]
        r = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=n, temperature=0
        )
        return r.choices[0].message.content

    assert chat([{"type": "text", "text": "hi"}]) == ref.text("hi", 8, chat=True)
    parts = [{"type": "text", "text": "Once"}, {"type": "text", "text": "upon"}]
    assert chat(parts) == ref.text("Once\nupon", 8, chat=True)
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    for content, named in (
        ([image], "'image_url'"),
        ([{"text": "no type"}], "'no type'"),
        (5, "int"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            chat(content)
        assert "messages[0].content" in err.value.body["message"], err.value.body
        assert named in err.value.body["message"], err.value.body


class _FailOnce:
    """A slot generator whose next decode fails (a device error), then works again."""

    def __init__(self, gen):
        self.gen, self.failed = gen, False

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def decode(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return self.gen.decode()


def test_a_failed_generation_fails_that_request_and_serving_goes_on():
    from starlette.testclient import TestClient

    from neuron_tp import init_mesh
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.server import _load, create_app

    engine = Engine()
    _load(engine, _config(0), init_mesh(tp=1))
    engine.gen = _FailOnce(engine.gen)
    engine.start()
    with TestClient(create_app(engine, "x")) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.json()
    engine.shutdown(5)


# -- host_broadcast on 2 gloo ranks --------------------------------------------------------


def _broadcast_rounds() -> None:
    import torch.distributed as dist

    from neuron_tp import init_mesh
    from neuron_tp.parallel import comm

    group = init_mesh(tp=2).group("world")
    store = dist.distributed_c10d._get_default_store()
    if group.rank == 1:  # a follower's finite wait raises and does not consume the round
        with pytest.raises(TimeoutError):
            comm.host_broadcast("t", None, group, timeout_s=0.2)
    dist.barrier()
    for n in range(6):
        payload = f"round {n}".encode() if group.rank == 0 else None
        assert comm.host_broadcast("t", payload, group) == f"round {n}".encode()
        dist.barrier()  # every rank has read round n
    if group.rank == 0:  # acknowledged rounds are deleted when the next one is set
        comm.host_broadcast("t", b"last", group)
        assert not store.check(["ntp/bcast/t/0-1/0/0"]) and not store.check(["ntp/bcast/t/0-1/0/4"])
    else:
        assert comm.host_broadcast("t", None, group) == b"last"


def test_host_broadcast_on_two_ranks():
    gloo_dist.run(_broadcast_rounds, world_size=2, timeout=120)


# -- tp=2: two torchrun ranks ----------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                if d.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    port = _free_port()
    o = OPTIONS
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "neuron_tp.cli", "serve", "--model", o["model"], "--tp", "2", "--device", "cpu",
        "--seed", str(o["seed"]), "--port", str(port), "--served-model-name", "tiny",
        "--buckets", ",".join(map(str, o["buckets"])),
        "--batch-buckets", ",".join(map(str, o["batch_buckets"])),
        "--max-new-tokens", str(o["max_new_tokens"]),
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("tp2") / "serve.log"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if _get(url + "/ready")[0] == 200:
                break
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    info = {"proc": proc, "ranks": _children(proc.pid), "log": log, "url": url}
    yield info
    if proc.poll() is None:
        proc.kill()
        for pid in info["ranks"]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_tp2_answers_like_tp1_and_shuts_down_cleanly(tp1, tp2):
    _, ref, _ = tp1
    url, client = tp2["url"], _client(tp2["url"])
    assert len(tp2["ranks"]) == 2
    assert _complete(client, "Hello", 10).choices[0].text == ref.text("Hello", 10)
    assert _chat(client, "hi", 8).choices[0].message.content == ref.text("hi", 8, chat=True)
    r = _complete(client, "Once upon", 12, temperature=0.8, seed=7, extra_body={"top_k": 20})
    assert r.choices[0].text == ref.text("Once upon", 12, Sampling(True, 0.8, 20, 7))
    assert _streamed(_complete(client, "Tensor", 16, stream=True), False)[0] == ref.text(
        "Tensor", 16
    )
    # concurrent: one batch, each row ends at its own max_tokens or stop string (the stopped
    # flags must be identical on both ranks, or they would run different steps and hang)
    full = ref.text("Hello", 16)
    stop = next(full[i] for i in range(2, len(full)) if full[i] != "\ufffd")
    asks = [(p, 3 + i % 6, []) for i, p in enumerate(PROMPTS[:4])] + [("Hello", 16, [stop])]
    barrier = threading.Barrier(len(asks))

    def ask(a):
        p, n, stops = a
        c = _client(url)
        barrier.wait()
        return _complete(c, p, n, stop=stops or None).choices[0].text

    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(ask, asks))
    assert got[:-1] == [ref.text(p, n) for p, n, _ in asks[:-1]]
    assert got[-1] == full[: full.index(stop)]
    with pytest.raises(openai.BadRequestError, match="exceeds the 56 positions of a slot"):
        _complete(client, "y" * 53, 4)
    assert _complete(client, "abc", 6).choices[0].text == ref.text("abc", 6)
    # SIGTERM to torchrun: every rank ends, nothing is left behind
    proc, ranks = tp2["proc"], tp2["ranks"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(45)
    deadline = time.monotonic() + 10
    while any(map(_alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, ranks)), "orphaned ranks"
    log = tp2["log"].read_text()
    assert "[rank0]:" not in log and "[rank1]:" not in log, log[-3000:]  # no rank tracebacks
    assert "forcefully exiting" not in log, log[-3000:]  # ended within torchrun's grace

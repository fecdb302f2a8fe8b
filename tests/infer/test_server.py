"""``neuron-tp serve`` with the real ``openai`` client: completions and chat equal what
:class:`neuron_tp.infer.static_generator.Generator` gives directly (greedy and seeded sampling),
streaming, stop strings, concurrent clients, a client that disconnects mid-stream, refused
requests; at tp=1 in this process and at tp=2 as two torchrun ranks (gloo) with ``--quantize
int8``, whose tokens equal those of the tp=1 model quantized in this process (same preset and
seed: the same full model, sharded, then quantized), themselves equal to transformers' on the
dequantized weights. Also
:func:`neuron_tp.parallel.host.broadcast` on two gloo ranks."""

from __future__ import annotations

import copy
import http.client
import json
import logging
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
import torch

import gloo_dist
from http_app import free_port as _free_port
from http_app import listen as _listen
from neuron_tp.infer.completion_request import chat_prompt, encode_prompt
from neuron_tp.infer.sampling import GREEDY, Sampling
from neuron_tp.infer.static_generator import Generator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTIONS = {
    "model": "tiny-llama",
    "seed": 3,
    "buckets": [16, 32],
    "batch_buckets": [1, 2, 4],
    "max_new_tokens": 24,
}
PROMPTS = ["Hello", "The cat", "Once upon", "abc", "xyz!", "Hi there", "Tensor", "A"]


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
        self.gen = Generator(
            model, OPTIONS["buckets"], OPTIONS["max_new_tokens"], batch_buckets=[1], pad_id=0
        )
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
    from neuron_tp import init_mesh
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.serve_command import load_engine as _load
    from neuron_tp.infer.server import create_app

    config = _config(_free_port())
    mesh = init_mesh(tp=1)
    engine = Engine(max_queue=256)  # serve's default queue bound
    _load(engine, config, mesh)
    engine.start()
    stop = _listen(create_app(engine, "tiny"), config.port)
    ref = Reference(engine.gen.model, engine.tokenizer, engine.eos_ids)
    yield engine, ref, f"http://127.0.0.1:{config.port}"
    stop()
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
    ({"prompt": "hi", "temperature": -0.5}, "temperature must be a number in 0..2, got -0.5"),
    ({"prompt": "hi", "n": 0}, "n must be an integer in 1.."),
    ({"prompt": "hi", "max_tokens": 1000}, "max_tokens must be an integer in 1..24 (server limit"),
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


def test_chat_only_and_completion_only_fields_are_refused_on_the_other(tp1):
    _, _, url = tp1
    client = _client(url)
    asks = [
        (lambda: _chat(client, "hi", 4, extra_body={"echo": "yes"}), "echo"),
        (lambda: _chat(client, "hi", 4, parallel_tool_calls=False), "parallel_tool_calls"),
        (lambda: _chat(client, "hi", 4, logprobs=2), "logprobs"),
        (lambda: _chat(client, "hi", 4, top_logprobs=3), "top_logprobs"),
        (lambda: _complete(client, "Hello", 4, extra_body={"top_logprobs": 3}), "top_logprobs"),
        (
            lambda: _complete(
                client, "Hello", 4, extra_body={"response_format": {"type": "json_object"}}
            ),
            "response_format",
        ),
        (lambda: _complete(client, "Hello", 4, extra_body={"tools": []}), "tools"),
    ]
    for ask, name in asks:
        with pytest.raises(openai.BadRequestError) as err:
            ask()
        assert err.value.body["param"] == name, err.value.body
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


# -- limits, API key, backpressure, timeout, metrics ---------------------------------------

KEY = "sekrit-key-28"
TIMEOUT_S = 2.0  # the guarded app's --request-timeout-s
BODY_LIMIT = 256 * 1024  # the guarded app's --max-body-bytes


@pytest.fixture(scope="module")
def guarded(tp1):
    """(app, base url) of a second app on tp1's engine with an API key, a small body limit
    and a short request timeout."""
    from neuron_tp.infer.limits import ServeLimits
    from neuron_tp.infer.server import create_app

    engine, _, _ = tp1
    limits = ServeLimits(api_key=KEY, max_body_bytes=BODY_LIMIT, request_timeout_s=TIMEOUT_S)
    app = create_app(engine, "tiny", limits)
    port = _free_port()
    stop = _listen(app, port)
    yield app, f"http://127.0.0.1:{port}"
    stop()


def _raw(url: str, path: str, body=None, headers=None, method="POST", timeout=20):
    """(status, headers, parsed JSON or text) of one request; ``body``: bytes or a JSON value."""
    host, port = url.removeprefix("http://").split(":")
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode()
        try:
            return r.status, dict(r.getheaders()), json.loads(text)
        except json.JSONDecodeError:
            return r.status, dict(r.getheaders()), text
    finally:
        conn.close()


def _keyed(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _declared_only(url: str, size: int) -> tuple[int, dict]:
    """Headers declaring a ``size``-byte body, then (before sending any of it) the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
        )
        s.sendall(head.encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            got = s.recv(65536)
            if not got:
                break
            reply += got
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.split(b"\r\n\r\n", 1)[1])


def _chunked(url: str, chunks) -> tuple[int, dict]:
    """A body sent with Transfer-Encoding: chunked (no Content-Length), then the answer."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        conn.request("POST", "/v1/completions", iter(chunks), headers, encode_chunked=True)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _nested(depth: int) -> bytes:
    """A completion request (max_tokens 4) with a field nesting arrays ``depth`` deep."""
    return b'{"prompt": "Hello", "max_tokens": 4, "temperature": 0, "x": ' + (
        b"[" * depth + b"]" * depth + b"}"
    )


def test_bad_requests_from_the_issue_each_followed_by_a_good_one(tp1, guarded):
    engine, ref, _ = tp1
    _, url = guarded
    vocab = engine.gen.model.config.vocab_size
    auth = {"Authorization": f"Bearer {KEY}"}
    good = ref.text("Hello", 4)
    hi = {"prompt": "Hello", "max_tokens": 4}
    too_big = b'{"prompt": "' + b"x" * (20 * 1024 * 1024) + b'"}'
    # (body, status, words of the message, param)
    cases = [
        ({**hi, "seed": 2**80}, 400, "seed must be an integer in 0..9223372036854775807", "seed"),
        ({**hi, "seed": -1}, 400, "seed must be an integer in 0..", "seed"),
        ({**hi, "seed": 2**63}, 400, "seed must be an integer in 0..", "seed"),
        (_nested(100_000), 400, "nest", None),
        (_nested(64), 400, "nests 65 deep", None),  # the object is one level
        (b'{"prompt": "Hello", "x": [' + b"[]," * 65534 + b"[]]}", 400, "has 65537 JSON", None),
        (b'{"prompt": "Hello", "max_tokens": ' + b"9" * 5000 + b"}", 400, "not valid JSON", None),
        (b'{"prompt": "Hello", "temperature": NaN}', 400, "temperature must be a number", None),
        (b'{"prompt": "Hello", "temperature": 1e999}', 400, "temperature must be a number", None),
        ({**hi, "temperature": 2.5}, 400, "temperature must be a number in 0..2", "temperature"),
        ({**hi, "top_k": vocab + 1}, 400, f"top_k must be an integer in 0..{vocab}", "top_k"),
        ({**hi, "max_tokens": 25}, 400, "1..24 (server limit: neuron-tp serve --max-new-", None),
        ({**hi, "max_tokens": 2**70}, 400, "max_tokens must be an integer in 1..24", None),
        ({**hi, "n": 2**70}, 400, "n must be an integer in 1..", "n"),
        ({**hi, "top_p": 0}, 400, "top_p must be in (0, 1]", "top_p"),
        ({**hi, "top_p": 1.5}, 400, "top_p must be a number in 0..1", "top_p"),
        ({**hi, "presence_penalty": 2.5}, 400, "presence_penalty must be a number in -2..2", None),
        ({**hi, "frequency_penalty": -3}, 400, "frequency_penalty must be a number in", None),
        ({**hi, "min_p": 1.5}, 400, "min_p must be a number in 0..1", "min_p"),
        ({**hi, "repetition_penalty": 0}, 400, "repetition_penalty must be in (0, 10]", None),
        ({**hi, "logit_bias": {"x": 1}}, 400, "logit_bias: 'x' is not a token id", None),
        ({**hi, "logit_bias": {str(vocab): 1}}, 400, f"logit_bias: {vocab} is not a", None),
        ({**hi, "logit_bias": {"5": 101}}, 400, "logit_bias must be a number in -100..100", None),
        ({**hi, "stop_token_ids": [vocab]}, 400, f"stop_token_ids: {vocab} is not", None),
        ({**hi, "logprobs": 21}, 400, "logprobs must be an integer in 0..20", "logprobs"),
        (
            {**hi, "max_tokens": 0},
            400,
            "max_tokens must be an integer in 1..24 (server limit: neuron-tp serve "
            "--max-new-tokens; 0 with echo)",
            None,
        ),
        ({**hi, "n": 2, "best_of": 1}, 400, "best_of must be >= n (2), got 1", "best_of"),
        ({**hi, "best_of": 2, "stream": True}, 400, "best_of > n cannot be streamed", "best_of"),
        ({**hi, "best_of": 257}, 400, "at most 256 sequences per request", "best_of"),
        ({**hi, "suffix": "x"}, 400, "suffix: insertion (suffix) is not supported", "suffix"),
        ({**hi, "response_format": {"type": "json_object"}}, 400, "structured outputs", None),
        ({**hi, "tools": [{"type": "function"}]}, 400, "unknown field 'tools'", "tools"),
        ({**hi, "ignore_eos": True}, 400, "unknown field 'ignore_eos'", "ignore_eos"),
        ({**hi, "stream": "yes"}, 400, "stream must be a boolean", "stream"),
        ({**hi, "stream_options": 3}, 400, "stream_options must be an object", None),
        ({**hi, "prompt": [1, 2, vocab]}, 400, f"prompt[2]: {vocab} is not a token id", None),
        ({**hi, "prompt": [[1, 2], [3, -1]]}, 400, "prompt[1][1]: -1 is not a token id", None),
        ({**hi, "prompt": [[1], []]}, 400, "prompt[1] has no token ids", "prompt"),
        ({**hi, "prompt": [[1], ["a"]]}, 400, "prompt[1][0]: 'a' is not a token id", None),
        ({**hi, "prompt": [1] * 53}, 400, "exceeds the 56 positions of a slot", None),
        ({**hi, "prompt": ["a"] * 257}, 400, "at most 256 sequences per request", "prompt"),
        (too_big, 413, f"limit of {BODY_LIMIT} bytes", None),
        (b"[1, 2]", 400, "must be a JSON object", None),
        (b'{"prompt": "\xff\xfe"}', 400, "not valid JSON (UTF-8)", None),
        (b'{"prompt": "Hello",', 400, "not valid JSON", None),
    ]
    client = _keyed(url)
    for body, status, words, param in cases:
        code, _, answer = _raw(url, "/v1/completions", body, auth)
        what = body[:80] if isinstance(body, bytes) else body
        assert code == status, (what, answer)
        assert words in answer["error"]["message"], (what, answer)
        assert param is None or answer["error"]["param"] == param, (what, answer)
        if f"{vocab}" in words and "token id" in words:  # names the valid range too
            assert f"valid: 0..{vocab - 1}" in answer["error"]["message"]
        assert _complete(client, "Hello", 4).choices[0].text == good, what
    # a body at the limits passes the JSON guard, 64 deep (63 in "x"): refused only for its
    # unknown field; a seed of 2**63 - 1 is served
    code, _, answer = _raw(url, "/v1/completions", _nested(63), auth)
    assert code == 400 and "unknown field 'x'" in answer["error"]["message"], answer
    r = _complete(client, "Hello", 4, temperature=0.7, seed=2**63 - 1)
    assert r.choices[0].text == ref.text("Hello", 4, Sampling(True, 0.7, 0, 2**63 - 1))
    # too large, refused from the Content-Length before any of the body is read; or read
    # only up to the limit when chunked; each followed by a good request
    assert _declared_only(url, 20 * 1024 * 1024)[0] == 413
    assert _complete(client, "Hello", 4).choices[0].text == good
    over = [b'{"prompt": "', b"y" * BODY_LIMIT, b'"}']
    status, answer = _chunked(url, over)
    assert status == 413 and "--max-body-bytes" in answer["error"]["message"]
    assert _complete(client, "Hello", 4).choices[0].text == good
    status, answer = _chunked(url, [b'{"prompt": "Hel', b'lo", "max_tokens": 4, "temperature": 0}'])
    assert status == 200 and answer["choices"][0]["text"] == good


def test_token_id_prompts_equal_the_text_prompts(tp1):
    engine, ref, url = tp1
    client = _client(url)
    ids = [engine.tokenizer.encode(p) for p in ("Hello", "The cat")]
    by_text = _complete(client, ["Hello", "The cat"], 6)
    one = _complete(client, ids[0], 6)
    assert one.choices[0].text == ref.text("Hello", 6) == by_text.choices[0].text
    assert (
        one.usage.prompt_tokens == len(ids[0]) == _complete(client, "Hello", 6).usage.prompt_tokens
    )
    both = _complete(client, ids, 6)
    assert [c.text for c in both.choices] == [c.text for c in by_text.choices]
    assert both.usage == by_text.usage


def test_api_key_is_asked_on_every_path_but_the_probes(guarded):
    from neuron_tp.infer.limits import OPEN_PATHS

    app, url = guarded
    paths = {(r.path, m) for r in app.routes for m in getattr(r, "methods", ()) if m != "HEAD"}
    assert ("/v1/models", "GET") in paths and ("/v1/chat/completions", "POST") in paths
    bodies = {
        "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
        "/v1/chat/completions": {"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        "/v1/load_lora_adapter": {"lora_name": "x", "lora_path": "/nowhere"},
        "/v1/unload_lora_adapter": {"lora_name": "x"},
    }
    keyed = {"/v1/load_lora_adapter": 400, "/v1/unload_lora_adapter": 400}  # no LoRA here
    for path, method in sorted(paths):
        data = bodies[path] if method == "POST" else None
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            status, got, answer = _raw(url, path, data, headers, method)
            if path in OPEN_PATHS:
                assert status == 200, (path, headers, answer)
                continue
            assert status == 401, (path, headers, answer)
            assert answer["error"]["code"] == "invalid_api_key" and got["www-authenticate"]
        status, _, answer = _raw(url, path, data, {"Authorization": f"bearer {KEY}"}, method)
        assert status == keyed.get(path, 200), (path, answer)
    assert _raw(url, "/nowhere", None, {}, "GET")[0] == 401  # not even a 404 without the key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in _keyed(url).models.list()] == ["tiny"]


class _Gate:
    """Holds the engine's worker: a request whose consumer waits (on the worker thread) until
    :meth:`open`, so later requests wait in the queue."""

    def __init__(self, engine):
        self.engine, self.started, self.gate = engine, threading.Event(), threading.Event()

    def __enter__(self):
        ids = self.engine.tokenizer.encode("Hello")
        self.engine.submit(ids, 8, GREEDY, [], sink=self._sink)
        assert self.started.wait(30), "the engine did not run the gate request"
        return self

    def _sink(self, event):
        self.started.set()
        self.gate.wait(60)

    def open(self):
        self.gate.set()

    def __exit__(self, *exc):
        self.gate.set()


def _until(condition, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_full_queue_gets_429_with_retry_after(tp1):
    from prometheus_client.parser import text_string_to_metric_families

    engine, ref, url = tp1
    bound, engine.max_queue = engine.max_queue, 2
    pool = ThreadPoolExecutor(2)
    try:
        with _Gate(engine) as gate:
            assert engine.slots_in_use() == 1 and engine.queue_depth() == 0
            waiting = [
                pool.submit(lambda p=p: _complete(_client(url), p, 5).choices[0].text)
                for p in ("The cat", "abc")
            ]
            _until(lambda: engine.queue_depth() == 2, "the two requests did not queue")
            status, headers, answer = _raw(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert status == 429 and headers["retry-after"] == "1", answer
            assert answer["error"]["code"] == "queue_full" and "--max-queue" in str(answer)
            with pytest.raises(openai.RateLimitError):
                _complete(_client(url), ["x", "y"], 2)  # nothing of it is queued either
            assert engine.queue_depth() == 2
            _, _, text = _raw(url, "/metrics", method="GET")
            gauges = {
                f.name: f.samples[0].value
                for f in text_string_to_metric_families(text)
                if f.name in ("neuron_tp_queue_depth", "neuron_tp_slots_in_use")
            }
            assert gauges == {"neuron_tp_queue_depth": 2, "neuron_tp_slots_in_use": 1}
            gate.open()
            assert [w.result(60) for w in waiting] == [ref.text("The cat", 5), ref.text("abc", 5)]
    finally:
        engine.max_queue = bound
        pool.shutdown()
    assert _complete(_client(url), "Hello", 4).choices[0].text == ref.text("Hello", 4)


def test_timed_out_request_is_cancelled_and_the_next_is_served(tp1, guarded, caplog):
    engine, ref, _ = tp1
    _, url = guarded
    caplog.set_level(logging.INFO, logger="neuron_tp.serve")
    client = _keyed(url)
    with _Gate(engine), ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        streamed = pool.submit(lambda: _streamed(_complete(client, "abc", 6, stream=True), False))
        with pytest.raises(openai.APIStatusError) as err:
            _complete(client, "The cat", 6)
        assert err.value.status_code == 504, err.value.body
        assert err.value.body["code"] == "request_timeout"
        # never before the timeout; the gate holds the engine, so only the timeout ends it
        assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 60
        with pytest.raises(openai.APIError, match="--request-timeout-s"):
            streamed.result(30)  # the stream ends with an error event
    assert _complete(client, "Hello", 6).choices[0].text == ref.text("Hello", 6)
    timed_out = [
        r.getMessage() for r in caplog.records if "finish_reason=timeout" in r.getMessage()
    ]
    assert len(timed_out) == 2 and all("status=" in m for m in timed_out), timed_out


def test_metrics_count_what_was_sent_and_each_request_logs_one_line(tp1, caplog):
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from neuron_tp.infer.server import create_app

    engine, ref, _ = tp1
    caplog.set_level(logging.INFO, logger="neuron_tp.serve")
    with TestClient(create_app(engine, "tiny")) as c:  # an app of its own: counts from 0
        answers = []
        for prompt, n in (("Hello", 5), (["The cat", "abc"], 3), ("Tensor", 1)):
            r = c.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0}
            )
            assert r.status_code == 200
            answers.append(r.json())
        r = c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "temperature": 0,
            },
        )
        answers.append(r.json())
        lines = c.post(
            "/v1/completions",
            json={
                "prompt": "A",
                "max_tokens": 4,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ).text.splitlines()
        answers.append(json.loads([x for x in lines if '"usage"' in x][-1].removeprefix("data: ")))
        assert c.post("/v1/completions", json={"prompt": "x", "seed": 2**80}).status_code == 400
        assert c.post("/v1/completions", content=b"{").status_code == 400
        assert c.post("/v1/completions", json={"prompt": "x", "model": "gpt"}).status_code == 404
        assert c.get("/v1/models").status_code == 200
        assert c.get("/nowhere").status_code == 404
        scraped = c.get("/metrics")
    assert scraped.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(scraped.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def value(name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))), 0)

    requests = "neuron_tp_requests_total"
    assert value(requests, endpoint="/v1/completions", status="200") == 4
    assert value(requests, endpoint="/v1/completions", status="400") == 2
    assert value(requests, endpoint="/v1/completions", status="404") == 1
    assert value(requests, endpoint="/v1/chat/completions", status="200") == 1
    assert value(requests, endpoint="/v1/models", status="200") == 1
    assert value(requests, endpoint="other", status="404") == 1
    usage = [a["usage"] for a in answers]
    assert value("neuron_tp_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert value("neuron_tp_generation_tokens_total") == sum(u["completion_tokens"] for u in usage)
    assert value("neuron_tp_time_to_first_token_seconds_count") == 5  # generation requests
    assert value("neuron_tp_request_duration_seconds_count") == 5
    tok, chat = engine.tokenizer, chat_prompt(engine.tokenizer, [{"role": "user", "content": "hi"}])
    asked = [("Hello", 5), ("The cat", 3), ("abc", 3), ("Tensor", 1), ("A", 4)]
    lengths = [len(ref.tokens(tok.encode(p), n)) for p, n in asked]
    lengths.append(len(ref.tokens(encode_prompt(tok, chat, chat=True), 4)))
    assert value("neuron_tp_generation_tokens_total") == sum(lengths)
    tpot = "neuron_tp_time_per_output_token_seconds_count"
    assert value(tpot) == sum(n > 1 for n in lengths)  # per choice of more than one token
    assert value("neuron_tp_queue_depth") == 0 and value("neuron_tp_slots_in_use") == 0
    logged = [r.getMessage() for r in caplog.records if r.name == "neuron_tp.serve"]
    assert len(logged) == 5 + 3, logged  # a line per generation request, refused ones too
    for a in answers:
        (line,) = [m for m in logged if a["id"] in m]
        u = a["usage"]
        assert f"status=200 prompt_tokens={u['prompt_tokens']} " in line, line
        assert f"completion_tokens={u['completion_tokens']} ttft_ms=" in line, line
        assert "duration_ms=" in line and "finish_reason=" in line, line


def test_an_exception_in_a_handler_fails_only_that_request(tp1, monkeypatch):
    from neuron_tp.infer import completion_request

    _, ref, url = tp1

    def broken(*args, **kwargs):
        raise RuntimeError("template exploded")

    monkeypatch.setattr(completion_request, "chat_prompt", broken)
    client = _client(url)
    with pytest.raises(openai.InternalServerError) as err:
        _chat(client, "hi", 4)
    assert err.value.status_code == 500 and "RuntimeError" in err.value.body["message"]
    assert err.value.body["type"] == "server_error"
    assert _complete(client, "Hello", 4).choices[0].text == ref.text("Hello", 4)
    assert _get(url + "/health")[0] == 200


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
    from neuron_tp.infer.serve_command import load_engine as _load
    from neuron_tp.infer.server import create_app

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
    from neuron_tp.parallel import host

    group = init_mesh(tp=2).group("world")
    store = dist.distributed_c10d._get_default_store()
    if group.rank == 1:  # a follower's finite wait raises and does not consume the round
        with pytest.raises(TimeoutError):
            host.broadcast("t", None, group, timeout_s=0.2)
    dist.barrier()
    for n in range(6):
        payload = f"round {n}".encode() if group.rank == 0 else None
        assert host.broadcast("t", payload, group) == f"round {n}".encode()
        dist.barrier()  # every rank has read round n
    if group.rank == 0:  # acknowledged rounds are deleted when the next one is set
        host.broadcast("t", b"last", group)
        assert not store.check(["ntp/bcast/t/0-1/0/0"]) and not store.check(["ntp/bcast/t/0-1/0/4"])
    else:
        assert host.broadcast("t", None, group) == b"last"


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


def _stop(proc: subprocess.Popen, ranks: list[int]) -> None:
    """A fixture's teardown: SIGTERM to the launcher, then kill it and any rank left."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(45)
    except subprocess.TimeoutExpired:
        proc.kill()
    for pid in ranks:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _serve(cmd: list[str], env: dict, log, port: int) -> tuple[subprocess.Popen, str]:
    """Start ``cmd`` (a torchrun ``neuron-tp serve``), its output in ``log``; return it and its
    base url once ``/ready`` answers 200 (fails with the log's tail if it dies or takes 120 s)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if _get(url + "/ready")[0] == 200:
                return proc, url
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> dict[str, str]:
    """PEFT adapters of the tiny preset (tests/helpers/lora_serving.py) for the tp=2 server."""
    from lora_serving import write_adapter

    root = str(tmp_path_factory.mktemp("adapters"))
    return {n: write_adapter(root, n, seed=i + 1) for i, n in enumerate(("alpha", "beta"))}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, lora):
    """``neuron-tp serve --tp 2 --quantize int8`` over torchrun, with LoRA adapter alpha."""
    port = _free_port()
    o = OPTIONS
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "neuron_tp.cli", "serve", "--model", o["model"], "--tp", "2", "--device", "cpu",
        "--seed", str(o["seed"]), "--port", str(port), "--served-model-name", "tiny",
        "--buckets", ",".join(map(str, o["buckets"])),
        "--batch-buckets", ",".join(map(str, o["batch_buckets"])),
        "--max-new-tokens", str(o["max_new_tokens"]),
        "--max-queue", "64", "--request-timeout-s", "120", "--max-body-bytes", "100000",
        "--quantize", "int8",
        "--lora-modules", f"alpha={lora['alpha']}", "--max-loras", "2", "--max-lora-rank", "8",
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("tp2") / "serve.log"
    # the key from the environment: _client sends "Bearer none"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1", "NEURON_TP_API_KEY": "none"}
    proc, url = _serve(cmd, env, log, port)
    info = {"proc": proc, "ranks": _children(proc.pid), "log": log, "url": url}
    yield info
    if proc.poll() is None:
        proc.kill()
        for pid in info["ranks"]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _int8_reference(tp1) -> Reference:
    """The tp=1 model quantized in this process (``ntp.quantize``), its greedy tokens checked
    against transformers' ``generate`` on the unsharded model with dequantized int8 weights."""
    from int8_reference import reference_model
    from neuron_tp.job.presets import build_model
    from neuron_tp.layers.quantized import quantize_int8
    from neuron_tp.parallel.state import mesh_of

    engine, _, _ = tp1
    model = quantize_int8(copy.deepcopy(engine.gen.model), mesh_of(engine.gen.model))
    ref = Reference(model, engine.tokenizer, engine.eos_ids)
    dq = reference_model(build_model(OPTIONS["model"], 257, OPTIONS["seed"]).eval()).eval()
    ids = engine.tokenizer.encode("Once upon")
    want = dq.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :]
    got = ref.tokens(ids, 12)
    assert got and got == want.tolist()[: len(got)], (got, want)
    return ref


def _lora_text(full, tok, eos, prompt: str, n: int) -> str:
    ids = tok.encode(prompt)
    with torch.no_grad():
        out = full.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=eos
        )[0, len(ids) :].tolist()
    ends = [i for i, t in enumerate(out) if t in eos]
    return tok.decode(out[: ends[0]] if ends else out)


def test_tp2_int8_serves_lora_adapters_like_peft_merged(tp1, tp2, lora):
    """The same server (int8 base weights, tp 2): requests naming alpha (from --lora-modules)
    and beta (POSTed at run time, then in one batch with the base and alpha) equal
    transformers on peft's merge of the adapter into the dequantized int8 base; the ranks'
    banks change at the same step (a divergence would hang or mix tokens)."""
    from int8_reference import reference_model
    from lora_serving import merged
    from neuron_tp.job.presets import build_model

    engine, _, _ = tp1
    tok, eos = engine.tokenizer, engine.eos_ids
    dq = reference_model(build_model(OPTIONS["model"], 257, OPTIONS["seed"]).eval()).eval()
    refs = {"tiny": dq, **{n: merged(p, dq) for n, p in lora.items()}}
    url, client = tp2["url"], _client(tp2["url"])
    assert [m.id for m in client.models.list().data] == ["tiny", "alpha"]
    r = client.completions.create(model="alpha", prompt="Hello", max_tokens=10, temperature=0)
    assert r.choices[0].text == _lora_text(refs["alpha"], tok, eos, "Hello", 10)
    body = json.dumps({"lora_name": "beta", "lora_path": lora["beta"]}).encode()
    status, _, text = _raw(url, "/v1/load_lora_adapter", body, {"Authorization": "Bearer none"})
    assert status == 200 and "beta" in text, text
    asks = [(m, p) for m in ("tiny", "alpha", "beta") for p in ("Hi", "The cat")]
    barrier = threading.Barrier(len(asks))

    def ask(a):
        c = _client(url)
        barrier.wait()
        return c.completions.create(model=a[0], prompt=a[1], max_tokens=8, temperature=0)

    with ThreadPoolExecutor(len(asks)) as pool:
        got = [r.choices[0].text for r in pool.map(ask, asks)]
    assert got == [_lora_text(refs[m], tok, eos, p, 8) for m, p in asks]


def test_tp2_int8_answers_like_tp1_int8_and_shuts_down_cleanly(tp1, tp2):
    """``neuron-tp serve --quantize int8 --tp 2`` (torchrun, gloo): the tokens of the tp=1
    model quantized in this process (itself equal to transformers on the dequantized
    weights), greedy, sampled, streamed, concurrent; then the server's own checks."""
    ref = _int8_reference(tp1)
    url, client = tp2["url"], _client(tp2["url"])
    assert len(tp2["ranks"]) == 2
    assert _complete(client, "Hello", 10).choices[0].text == ref.text("Hello", 10)
    assert _chat(client, "hi", 8).choices[0].message.content == ref.text("hi", 8, chat=True)
    r = _complete(client, "Once upon", 12, temperature=0.8, seed=7, extra_body={"top_k": 20})
    assert r.choices[0].text == ref.text("Once upon", 12, Sampling(True, 0.8, 20, 7))
    assert _streamed(_complete(client, "Tensor", 16, stream=True), False)[0] == ref.text(
        "Tensor", 16
    )
    # best_of: candidates drawn with seed + j, sharing the prompt's prefill on both ranks; the
    # one the tp=1 model gives the highest summed log-probability answers
    ids = ref.tok.encode("Once upon")
    cands = [ref.tokens(ids, 8, Sampling(True, 1.0, 0, 3 + j)) for j in range(3)]
    assert not {t for c in cands for t in c} & set(ref.eos) and len(set(map(tuple, cands))) == 3
    with ref.lock, torch.no_grad():
        lps = [
            ref.gen.model(torch.tensor([ids + c])).logits[0].float().log_softmax(-1) for c in cands
        ]
    scores = [
        sum(float(lp[len(ids) - 1 + k, t]) for k, t in enumerate(c)) for lp, c in zip(lps, cands)
    ]
    r = _complete(client, "Once upon", 8, temperature=1.0, seed=3, best_of=3)
    assert r.choices[0].text == ref.tok.decode(cands[max(range(3), key=lambda j: scores[j])])
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
    # lm-eval's loglikelihood request (its Output crosses the lease; the prompt log-probability
    # graph runs on both ranks): the tp=1 int8 model's log-probabilities
    ids = list(range(30, 70))  # two prefill chunks of 32
    r = _complete(client, ids, 1, logprobs=1, echo=True)
    with ref.lock, torch.no_grad():
        want = ref.gen.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    got = r.choices[0].logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids) + 1
    assert max(abs(got[k] - float(want[k - 1, ids[k]])) for k in range(1, len(ids))) < 2e-3
    # a grammar row on both ranks: valid JSON of the schema, ended by the grammar
    schema = {
        "type": "object",
        "properties": {"on": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
        "required": ["on", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    for kw in ({}, {"temperature": 1.0, "seed": 4}):
        r = _chat(client, "hi", 24, response_format=fmt, **kw).choices[0]
        value = json.loads(r.message.content)
        assert set(value) == {"on", "n"} and isinstance(value["on"], bool), value
        assert isinstance(value["n"], int) and value["n"] <= 99 and r.finish_reason == "stop"
    # refused before rank 0 broadcasts anything: the ranks stay in step
    with pytest.raises(openai.BadRequestError, match="seed must be an integer in 0.."):
        _complete(client, "Hello", 4, temperature=0.5, seed=2**80)
    assert _raw(url, "/v1/completions", b"[" * 100_000, {"Authorization": "Bearer none"})[0] == 400
    assert _raw(url, "/v1/completions", b" " * 100_001, {"Authorization": "Bearer none"})[0] == 413
    assert _raw(url, "/v1/models", None, {}, "GET")[0] == 401  # the key from the environment
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert _complete(client, "abc", 6).choices[0].text == ref.text("abc", 6)
    _, _, scraped = _raw(url, "/metrics", None, {}, "GET")
    assert 'neuron_tp_requests_total{endpoint="/v1/completions",status="200"}' in scraped
    # SIGTERM to torchrun: every rank ends, nothing is left behind
    proc, ranks = tp2["proc"], tp2["ranks"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(45)
    deadline = time.monotonic() + 10
    while any(map(_alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, ranks)), "orphaned ranks"
    log = tp2["log"].read_text()
    assert "--quantize int8: 14 linears quantized to int8 on load" in log, log[-3000:]
    assert "[rank0]:" not in log and "[rank1]:" not in log, log[-3000:]  # no rank tracebacks
    assert "neuron-tp serve: request cmpl-" in log and "status=400" in log, log[-3000:]
    assert "forcefully exiting" not in log, log[-3000:]  # ended within torchrun's grace


# -- an MoE directory at tp=2: two torchrun ranks ------------------------------------------


@pytest.fixture(scope="module")
def moe_tp2(tmp_path_factory):
    """A tiny Mixtral directory (output head scaled: sampling depends on the temperature;
    experts scaled: they decide the tokens) served at tp=2 (gloo, torchrun); yields
    (unsharded model, base url)."""
    from hf_sampling import peaked
    from moe_archs import build_moe, loud_experts

    tmp = tmp_path_factory.mktemp("moe")
    full = peaked(loud_experts(build_moe("mixtral", 2, vocab_size=257)), 8.0)
    full.save_pretrained(tmp / "model")
    port = _free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "neuron_tp.cli", "serve", "--model", str(tmp / "model"), "--tokenizer", "bytes",
        "--tp", "2", "--device", "cpu", "--port", str(port), "--served-model-name", "tiny",
        "--buckets", "16,32", "--batch-buckets", "1,2,4", "--max-new-tokens", "12",
    ]  # fmt: skip
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1"}
    log = tmp / "serve.log"
    proc, url = _serve(cmd, env, log, port)
    ranks = _children(proc.pid)
    yield full, url
    _stop(proc, ranks)


def test_moe_directory_tp2_answers_like_transformers_per_request(moe_tp2):
    """Concurrent requests (greedy and seeded sampling) on a tiny Mixtral at tp=2, each equal
    to transformers' ``generate`` of that request alone; decode runs slot buckets 4 (MoE dense
    mode: 4 tokens x top-2 >= 6 experts) and 1 (gather mode), prefill chunks dense."""
    from hf_sampling import hf_sample
    from neuron_tp.job.data import ByteTokenizer

    full, url = moe_tp2
    tok, eos = ByteTokenizer(), [int(full.generation_config.eos_token_id)]

    def expected(ids, n, sampling):
        with torch.no_grad():
            if sampling is None:
                out = full.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
                out = out[0, len(ids) :].tolist()
            else:
                out = hf_sample(full, [ids], n, *sampling)[0]
        return tok.decode([t for t in out if t not in eos])

    # (token ids, max tokens, (temperature, top_k, seed) or None for greedy)
    asks = [
        ([72, 101, 108, 108, 111], 10, None),
        ([84, 104, 101], 7, (0.8, 20, 7)),
        (list(range(97, 117)), 12, None),  # 20 tokens: two prefill chunks of 16
        ([65], 9, (1.3, 0, 11)),
        ([120, 121, 122, 33], 5, None),
    ]
    want = [expected(*a) for a in asks]
    barrier = threading.Barrier(len(asks))

    def ask(a):
        ids, n, sampling = a
        kw = {"temperature": 0}
        if sampling is not None:
            kw = {"temperature": sampling[0], "seed": sampling[2]}
            kw["extra_body"] = {"top_k": sampling[1]}
        c = _client(url)
        barrier.wait()
        return c.completions.create(model="tiny", prompt=ids, max_tokens=n, **kw).choices[0].text

    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(ask, asks))
    assert got == want
    assert got[1] != expected(asks[1][0], asks[1][1], None)  # sampling chose other tokens
    # alone: decode bucket 1 (gather mode)
    alone = _client(url).completions.create(
        model="tiny", prompt=asks[2][0], max_tokens=12, temperature=0
    )
    assert alone.choices[0].text == want[2]

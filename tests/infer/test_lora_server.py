"""``neuron-tp serve`` with LoRA adapters, through the real ``openai`` client (tp 1, in this
process; tp 2 over torchrun with int8 weights is in tests/infer/test_server.py): a request's
``model`` picks an adapter (its answer equals transformers on peft's merged model, greedy and
seeded sampling, streamed too), ``/v1/models`` lists the adapters under the base,
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change them while requests run,
prefix-cached blocks of one adapter are never used by another, and bad requests get a 4xx
naming the problem while the server goes on."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from http_app import free_port, listen
from lora_serving import BASE, base_model, foreign_adapter, merged, write_adapter

KEY = "lora-key"
MAX_NEW = 24


def _config(port: int, modules: list[str]):
    from neuron_tp.job.config import ServeConfig
    from neuron_tp.job.inference_config import ServeLoraConfig

    return ServeConfig(
        model=BASE,
        tp=1,
        device="cpu",
        seed=4,
        port=port,
        max_new_tokens=MAX_NEW,
        buckets=[16, 32],
        batch_buckets=[1, 2, 4],
        served_model_name="tiny",
        lora=ServeLoraConfig(lora_modules=modules, max_loras=2, max_lora_rank=8),
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(engine, base url, adapter paths) of an in-process tp=1 server with adapter alpha at
    start-up (--lora-modules), two bank slots and an API key."""
    from neuron_tp import init_mesh
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.limits import ServeLimits
    from neuron_tp.infer.serve_command import check_lora_options, load_engine
    from neuron_tp.infer.server import create_app

    root = str(tmp_path_factory.mktemp("adapters"))
    paths = {
        n: write_adapter(root, n, seed=i + 1) for i, n in enumerate(["alpha", "beta", "gamma"])
    }
    paths["foreign"] = foreign_adapter(root)
    config = _config(free_port(), [f"alpha={paths['alpha']}"])
    check_lora_options(config)
    engine = Engine(max_queue=64)
    load_engine(engine, config, init_mesh(tp=1))
    engine.start()
    stop = listen(create_app(engine, "tiny", ServeLimits(api_key=KEY)), config.port)
    yield engine, f"http://127.0.0.1:{config.port}", paths
    stop()
    engine.shutdown(10)


class Merged:
    """Texts from transformers' ``generate`` on peft's merged model of each adapter (the
    base for ``tiny``), decoded as the server does."""

    def __init__(self, engine, paths):
        base = base_model()
        self.models = {
            "tiny": base,
            **{n: merged(p, base) for n, p in paths.items() if n != "foreign"},
        }
        self.tok, self.eos = engine.tokenizer, engine.eos_ids

    def text(self, model: str, prompt: str, n: int, seed: int | None = None) -> str:
        from hf_sampling import hf_sample

        ids = self.tok.encode(prompt)
        with torch.no_grad():
            if seed is None:
                out = self.models[model].generate(
                    torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                    eos_token_id=self.eos,
                )[0, len(ids) :].tolist()  # fmt: skip
            else:
                out = hf_sample(self.models[model], [ids], n, 0.9, 0, seed, eos_token_id=self.eos)[
                    0
                ]
        ends = [i for i, t in enumerate(out) if t in self.eos]
        return self.tok.decode(out[: ends[0]] if ends else out)


@pytest.fixture(scope="module")
def ref(server):
    engine, _, paths = server
    return Merged(engine, paths)


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def _text(client, model: str, prompt: str, n: int = 12, **kw) -> str:
    kw.setdefault("temperature", 0)
    return client.completions.create(model=model, prompt=prompt, max_tokens=n, **kw).choices[0].text


def _post(url: str, path: str, body, key: str | None = KEY):
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_lists_the_adapters_under_the_base(server):
    _, url, paths = server
    cards = {m.id: m for m in _client(url).models.list().data}
    assert set(cards) == {"tiny", "alpha"}
    assert cards["alpha"].parent == "tiny" and cards["alpha"].root == paths["alpha"]
    assert getattr(cards["tiny"], "parent", None) is None


def test_an_adapter_answers_like_peft_merged(server, ref):
    _, url, _ = server
    client = _client(url)
    for model in ("tiny", "alpha"):
        assert _text(client, model, "Hello there") == ref.text(model, "Hello there", 12)
    r = client.completions.create(
        model="alpha", prompt="Once upon", max_tokens=12, temperature=0.9, seed=5
    )
    assert r.model == "alpha" and r.choices[0].text == ref.text("alpha", "Once upon", 12, seed=5)
    stream = client.completions.create(
        model="alpha", prompt="Tensor", max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == ref.text("alpha", "Tensor", 10)


def test_prefix_cache_keeps_adapters_apart(server, ref):
    """The same 44-token prompt (a full block of 32) under the base, alpha, the base again,
    alpha again: with prefix caching on (the default) each equals its own model (a block
    cached for one adapter and read by another would not)."""
    engine, url, _ = server
    client, prompt = _client(url), "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGH"
    hits = engine.prefix_stats().hit_tokens
    for model in ("tiny", "alpha", "tiny", "alpha"):
        assert _text(client, model, prompt, 8) == ref.text(model, prompt, 8), model
    assert engine.prefix_stats().hit_tokens > hits, "the repeated prompts hit no cached block"


def test_load_and_unload_at_run_time_while_requests_run(server, ref):
    """beta and gamma POSTed while alpha requests run: with two bank slots and three adapters
    concurrent mixed requests all equal their merged models; unloaded, beta is 404 until it
    is loaded again."""
    _, url, paths = server
    client = _client(url)
    assert _post(
        url, "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": paths["beta"]}
    ) == (
        200,
        "Success: LoRA adapter 'beta' added successfully.",
    )
    asks = [(m, p) for m in ("tiny", "alpha", "beta", "gamma") for p in ("Hi", "The cat")]
    barrier = threading.Barrier(len(asks) + 1)

    def ask(a):
        c = _client(url)
        barrier.wait()
        return _text(c, a[0], a[1], 10)

    with ThreadPoolExecutor(len(asks)) as pool:
        futures = [pool.submit(ask, a) for a in asks]
        status = _post(
            url, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": paths["gamma"]}
        )
        barrier.wait()
        got = [f.result() for f in futures]
    assert status[0] == 200
    assert got == [ref.text(m, p, 10) for m, p in asks]
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "beta"})[0] == 200
    with pytest.raises(openai.NotFoundError, match="'beta' does not exist"):
        _text(client, "beta", "Hi")
    status, body = _post(url, "/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert (
        _post(url, "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": paths["beta"]})[0]
        == 200
    )
    assert _text(client, "beta", "Hi", 10) == ref.text("beta", "Hi", 10)


def test_bad_loads_get_400_and_the_server_goes_on(server, ref, tmp_path):
    engine, url, paths = server
    load = "/v1/load_lora_adapter"
    cases = [
        ({"lora_name": "alpha", "lora_path": paths["gamma"]}, "already loaded"),
        ({"lora_name": "x", "lora_path": str(tmp_path)}, "no adapter_config.json"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "not a directory"),
        ({"lora_name": "x", "lora_path": paths["foreign"]}, "not a LoRA-capable projection"),
        ({"lora_name": "tiny", "lora_path": paths["gamma"]}, "other than the base"),
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_name": 3, "lora_path": paths["gamma"]}, "lora_name"),
        (b"{not json", "JSON"),
        ([1, 2], "JSON object"),
    ]
    for body, why in cases:
        status, answer = _post(url, load, body)
        assert status == 400 and why in answer["error"]["message"], (body, status, answer)
    assert _post(url, load, {"lora_name": "x", "lora_path": paths["gamma"]}, key=None)[0] == 401
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "alpha"}, key="wrong")[0] == 401
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        _text(_client(url), "nope", "Hi")
    assert "x" not in {m.id for m in _client(url).models.list().data}
    assert _text(_client(url), "alpha", "Hello there") == ref.text("alpha", "Hello there", 12)
    assert engine.error is None


def test_rank_over_the_limit_is_refused(server, tmp_path):
    _, url, _ = server
    from lora_serving import SPECS

    SPECS["wide"] = (16, 16, False, ["q_proj"])
    try:
        path = write_adapter(str(tmp_path), "wide", seed=9)
    finally:
        del SPECS["wide"]
    status, body = _post(url, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": path})
    assert status == 400 and "rank 16 exceeds --max-lora-rank 8" in body["error"]["message"]


def test_lora_options_refused_before_any_work(tmp_path):
    """What cannot be served is refused with the reason before a model is read."""
    import dataclasses

    from neuron_tp.errors import UserError
    from neuron_tp.infer.serve_command import check_lora_options

    good = write_adapter(str(tmp_path), "gamma", seed=3)
    config = _config(0, [f"g={good}"])
    check_lora_options(config)
    bad = {
        "NAME=DIR": [good],
        "no adapter_config.json": [f"g={tmp_path}"],
        "unique": [f"g={good}", f"g={good}"],
        '"name" and "path"': ['{"name": "g"}'],
    }
    for why, modules in bad.items():
        with pytest.raises(UserError, match=why):
            check_lora_options(_config(0, modules))
    check_lora_options(dataclasses.replace(config, draft_model="tiny-llama"))  # draft: no LoRA
    with pytest.raises(UserError, match="--adapter merges one adapter"):
        check_lora_options(dataclasses.replace(config, adapter=good))
    check_lora_options(_config(0, [json.dumps({"name": "g", "path": good})]))

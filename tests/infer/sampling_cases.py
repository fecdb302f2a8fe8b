"""Requests with every per-row sampling parameter and log-probabilities, run concurrently by
the serving engine, and their independent references written here in plain torch on
transformers' logits of the unsharded model (one request at a time): OpenAI's presence /
frequency penalties, vLLM's repetition penalty and a logit bias under greedy decoding token for
token, the allowed sets of top_p / min_p / top_k for sampled rows, the model's log-probabilities
of generated and prompt tokens, stop token ids. Shared by tests/infer/test_sampling_api.py on
one process, gloo ranks and XLA CPU device threads."""

from __future__ import annotations

import threading
import time

import torch

from hf_sampling import peaked
from neuron_tp.infer.grammar import json_grammar
from neuron_tp.infer.sampling import MAX_LOGPROBS, Sampling
from neuron_tp.infer.schedule import Delta, Done, Failed, Output, Prompt

VOCAB, SEED, SCALE = 257, 4, 4.0
EOS = [131, 215]
SLOTS, CHUNK, MAX_NEW = 3, 8, 10
LIMIT = 24  # the engine's max_tokens limit (the JSON cases need more than MAX_NEW)
SCHEMA = {
    "type": "object",
    "properties": {
        "k": {"enum": ["x", "yz"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["k", "n"],
    "additionalProperties": False,
}
SHAPES = dict(
    slots=SLOTS,
    max_len=40,
    chunk=CHUNK,
    prefill_buckets=[4, CHUNK],
    decode_buckets=[1, SLOTS],
    prompt_logprobs=True,
    top_p=True,
)
LP_TOL = 2e-3
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]  # one full chunk
LONG = list(range(40, 60))  # 20 tokens: three prefill chunks (8, 8, 4)


def full_model():
    """The unsharded reference model (output head scaled: penalties and filters matter)."""
    from neuron_tp.job.presets import build_model

    return peaked(build_model("tiny-llama", VOCAB, SEED), SCALE).eval()


def cases() -> list[dict]:
    """The requests: ``prompt``, ``max_tokens``, ``sampling``, ``output``, ``kind`` (what the
    check compares)."""
    lp = Output(logprobs=True)
    echo = Output(logprobs=True, prompt_logprobs=True)
    schema, anything = Output(grammar=json_grammar(SCHEMA)), Output(grammar=json_grammar(None))
    # two choices of one prompt first (the second copies the first's prefilled KV), then the
    # sampled row without top_p in slot 1 beside the top_p row in slot 2
    siblings = Output(logprobs=True, siblings="choices of LONG")
    return [
        dict(kind="greedy", prompt=LONG, max_tokens=MAX_NEW, sampling=Sampling(), output=siblings),
        dict(
            kind="allowed",
            prompt=LONG,
            max_tokens=MAX_NEW,
            sampling=Sampling(True, 1.3, 40, 12, min_p=0.3, frequency_penalty=0.5),
            output=siblings,
        ),
        dict(
            kind="allowed",
            prompt=PROMPT,
            max_tokens=MAX_NEW,
            sampling=Sampling(True, 1.0, 0, 11, top_p=0.6),
            output=lp,
        ),
        dict(kind="greedy", prompt=PROMPT, max_tokens=MAX_NEW, sampling=Sampling(), output=lp),
        dict(
            kind="greedy",
            prompt=PROMPT,
            max_tokens=MAX_NEW,
            sampling=Sampling(presence_penalty=-1.5, frequency_penalty=0.4),  # repeats
            output=Output(),
        ),
        dict(
            kind="greedy",
            prompt=PROMPT + [40, 42, 26, 26],  # plain greedy goes on with 26
            max_tokens=MAX_NEW,
            sampling=Sampling(repetition_penalty=1.6, logit_bias=((72, 2.5), (101, -50.0))),
            output=lp,
        ),
        dict(kind="greedy", prompt=LONG, max_tokens=0, sampling=Sampling(), output=echo),
        dict(kind="greedy", prompt=LONG[:13], max_tokens=1, sampling=Sampling(), output=echo),
        dict(kind="stop_id", prompt=PROMPT, max_tokens=MAX_NEW, sampling=Sampling(), output=None),
        dict(kind="json", prompt=PROMPT, max_tokens=LIMIT, sampling=Sampling(), output=schema),
        dict(
            kind="json",
            prompt=LONG[:6],
            max_tokens=LIMIT,
            sampling=Sampling(True, 1.5, 0, 7, logit_bias=((125, -20.0),)),
            output=schema,
        ),
        dict(
            kind="json",
            prompt=LONG[:3],
            max_tokens=LIMIT,
            sampling=Sampling(True, 1.0, 0, 1, logit_bias=((34, 8.0),)),  # a key, not just {}
            output=anything,
        ),
    ]


# -- the references: plain torch on transformers' logits -----------------------------------------


def logits_of(full, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float64 logits of the unsharded model."""
    with torch.no_grad():
        return full(torch.tensor([ids])).logits[0].double()


def adjusted(logits: torch.Tensor, s: Sampling, prompt: list[int], out: list[int]):
    """The logits after the logit bias, vLLM's repetition penalty and OpenAI's penalties."""
    logits = logits.clone()
    for t, b in s.logit_bias:
        logits[t] += b
    for t in set(prompt) | set(out):
        rp = s.repetition_penalty
        logits[t] = logits[t] / rp if logits[t] > 0 else logits[t] * rp
    for t in set(out):
        logits[t] -= s.frequency_penalty * out.count(t) + s.presence_penalty
    return logits


def allowed(logits: torch.Tensor, s: Sampling) -> set[int]:
    """The tokens a sampled row may draw: the top k of softmax(logits / T), then the smallest
    most-likely set whose (renormalised) mass reaches top_p, then those at least min_p times
    the most likely."""
    probs = torch.softmax(logits / s.temperature, -1)
    order = probs.argsort(descending=True).tolist()
    if s.top_k:
        order = order[: s.top_k]
    total = float(sum(probs[t] for t in order))
    kept, mass = [], 0.0
    for t in order:
        kept.append(t)
        mass += float(probs[t]) / total
        if mass >= s.top_p:
            break
    best = float(probs[order[0]])
    return {t for t in kept if float(probs[t]) >= s.min_p * best}


def greedy_reference(full, prompt: list[int], n: int, s: Sampling) -> list[int]:
    """Greedy tokens under the penalties and bias, up to and including the first EOS."""
    out: list[int] = []
    for _ in range(n):
        tok = int(adjusted(logits_of(full, prompt + out)[-1], s, prompt, out).argmax())
        out.append(tok)
        if tok in EOS:
            break
    return out


# -- running them --------------------------------------------------------------------------------


def run(engine, items: list[dict], timeout: float = 300) -> list[dict]:
    """Submit every request at once (stop ids of the ``stop_id`` case: the third token of
    plain greedy, ``stop_at``), wait for all; per request its tokens and events."""
    done = threading.Semaphore(0)
    results = [{"events": []} for _ in items]
    reqs = []

    def sink(i: int):
        def take(ev) -> None:
            results[i]["events"].append(ev)
            if isinstance(ev, (Done, Failed)):
                done.release()

        return take

    assert engine.wait_ready(timeout), "the engine did not become ready"
    for i, it in enumerate(items):
        output = it["output"] or Output(stop_ids=(it["stop_at"],))
        s = it["sampling"]
        reqs.append(
            engine.submit(
                it["prompt"], it["max_tokens"], s, [], sink=sink(i), seeded=True, output=output
            )
        )
    for _ in items:
        assert done.acquire(timeout=timeout), "a request hung"
    for r, req in zip(results, reqs):
        r["tokens"] = list(req.tokens)
    return results


def with_stop_ids(full, items: list[dict]) -> list[dict]:
    """``items`` with the ``stop_id`` cases' ``stop_at`` (plain greedy's third token)."""
    for it in items:
        if it["kind"] == "stop_id":
            it["stop_at"] = greedy_reference(full, it["prompt"], 3, Sampling())[2]
    return items


def check(full, items: list[dict], results: list[dict]) -> dict:
    """Every request against its reference; returns the largest log-probability error."""
    worst = 0.0
    for i, (it, r) in enumerate(zip(items, results)):
        what = f"request {i} ({it['kind']}, {it['sampling']})"
        events, tokens, s, prompt = r["events"], r["tokens"], it["sampling"], it["prompt"]
        assert isinstance(events[-1], Done), (what, events[-1])
        if it["kind"] == "greedy":
            want = greedy_reference(full, prompt, it["max_tokens"], s)
            assert tokens == want, f"{what}: {tokens} vs {want}"
        elif it["kind"] == "json":
            check_json(
                tokens, events, SCHEMA if it["output"].grammar == json_grammar(SCHEMA) else None
            )
        elif it["kind"] == "allowed":
            for k, t in enumerate(tokens):
                logits = adjusted(logits_of(full, prompt + tokens[:k])[-1], s, prompt, tokens[:k])
                assert t in allowed(logits, s), f"{what}: token {k} = {t} outside the set"
        else:
            want = greedy_reference(full, prompt, it["max_tokens"], Sampling())
            assert tokens == want[:3] and tokens[-1] == it["stop_at"], (what, tokens, want)
            assert events[-1].finish_reason == "stop"
        output = it["output"] or Output()
        worst = max(worst, _check_logprobs(full, it, r, output, what))
    return {"worst": worst}


def check_json(tokens: list[int], events: list, schema: dict | None) -> None:
    """The tokens are JSON text (bytes) valid under ``schema`` (None: any object), ended by
    the grammar (finish reason ``stop``, no EOS token)."""
    import json

    import jsonschema

    text = bytes(tokens).decode("utf-8")
    value = json.loads(text)
    jsonschema.validate(value, schema or {"type": "object"})
    assert events[-1].finish_reason == "stop" and not set(tokens) & set(EOS), (text, events[-1])


def _check_logprobs(full, it: dict, r: dict, output: Output, what: str) -> float:
    prompt, tokens, events = it["prompt"], r["tokens"], r["events"]
    ref = logits_of(full, prompt + tokens).log_softmax(-1)
    worst = 0.0
    got = [e for ev in events if isinstance(ev, Delta) for e in ev.logprobs]
    prompts = [ev for ev in events if isinstance(ev, Prompt)]
    if not output.logprobs:
        assert not got and not prompts, what
        return worst
    assert [e.token for e in got] == tokens, (what, got)
    entries = [(len(prompt) - 1 + k, e) for k, e in enumerate(got)]
    if output.prompt_logprobs:
        (p,) = prompts
        assert [e.token for e in p.logprobs] == prompt[1:], what
        entries += [(k, e) for k, e in enumerate(p.logprobs)]
    else:
        assert not prompts, what
    for pos, e in entries:
        row = ref[pos]
        worst = max(worst, abs(e.logprob - float(row[e.token])))
        values = torch.tensor([v for _, v in e.top], dtype=torch.float64)
        top = row.topk(MAX_LOGPROBS)
        worst = max(worst, float((values - top.values).abs().max()))
        assert [t for t, _ in e.top][:3] == top.indices[:3].tolist(), (what, pos)
    assert worst < LP_TOL, (what, worst)
    return worst


# -- the same on 2 XLA CPU devices ---------------------------------------------------------------


def xla_job(tp: int) -> dict:
    """The engine at ``tp`` on ``tp`` XLA CPU devices, every graph captured at warm-up: the
    cases' results on rank 0 and the graph counts after warm-up and at the end."""
    import copy

    import torch_xla

    import neuron_tp as ntp
    from neuron_tp import hf
    from neuron_tp.backend.graphs import graph_counters
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.slot_generator import SlotGenerator
    from neuron_tp.job.data import ByteTokenizer
    from neuron_tp.parallel.sharding import move_to
    from xla_dist import serial

    barrier = _BARRIERS[tp]
    mesh = ntp.init_mesh(tp=tp)
    with serial():
        full = full_model()
        items = with_stop_ids(full, cases())
    model = hf.parallelize(copy.deepcopy(full), mesh).eval()
    move_to(model, torch_xla.device())
    engine = Engine(mesh.group("world") if tp > 1 else None, lease_steps=3)
    engine.attach(SlotGenerator(model, **SHAPES), ByteTokenizer(), EOS, LIMIT)
    engine.warmup(every_shape=True)
    traces = engine.gen.traces
    barrier.wait()
    compiles = graph_counters()["compiles"]
    if mesh.rank != 0:
        engine.follow()
        barrier.wait()
        traced = [traces, engine.gen.traces]
        return {"traces": traced, "compiles": [compiles, compiles], "forked": engine.rows.forked}
    out: dict = {}

    def driver() -> None:
        try:
            out["results"] = run(engine, items)
        finally:
            engine.shutdown()

    thread = threading.Thread(target=driver)
    t0 = time.time()
    thread.start()
    engine.start(thread=False)
    thread.join()
    barrier.wait()
    return {
        "traces": [traces, engine.gen.traces],
        "compiles": [compiles, graph_counters()["compiles"]],
        "results": out["results"],
        "items": items,
        "forked": engine.rows.forked,
        "seconds": time.time() - t0,
    }


_BARRIERS = {n: threading.Barrier(n) for n in (1, 2)}

"""Speculative decoding (:mod:`neuron_tp.infer.speculative`, ``--draft-model``).

- The acceptance rules on probability tables: greedy (exact counts and tokens) and the
  rejection rule of sampling, whose emitted token streams are distributed as the target's
  alone (chi-square over many seeded rows, with the bonus token in the tested prefix).
- Greedy tokens under random arrival schedules equal transformers' own greedy generation of
  each request alone (= plain decoding) with three drafts: the target itself (every proposal
  accepted: K + 1 tokens per step), the target's first layer + head (some accepted), and a
  random model (none): eager CPU at tp 1, gloo at tp 2 (also through the serving engine with
  leases, and ``neuron-tp generate --draft-model``), XLA CPU devices at tp 1 and 2 with
  replayed graphs (their number fixed by the warm-up).
- Sampled end to end: the 3-token continuations of a tiny-vocabulary model drawn with a draft
  follow the target's exact distribution (chi-square).
- Refusals: another vocabulary, another tokenizer, K with no room in a slot, K < 1.
"""

from __future__ import annotations

import json

import pytest
import torch

import gloo_dist
from hf_sampling import peaked
from neuron_tp.errors import UserError
from neuron_tp.infer.ngram import NgramGenerator, propose_ngram
from neuron_tp.infer.sampling import Sampling
from neuron_tp.infer.speculative import SpeculativeGenerator, accept_greedy, accept_sampled
from slot_trace import Req, eos_ids, kv1_llama, make_requests, reference, run_schedule
from spec_models import chi_square, critical, exact_sequences, first_layers


def test_greedy_rule_on_tables():
    v = 5
    logits = torch.zeros(3, 4, v)
    best = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    logits.scatter_(2, best[..., None], 1.0)
    proposed = torch.tensor([[1, 2, 3], [1, 0, 3], [4, 2, 3]])
    got = accept_greedy(proposed, logits)
    assert got.accepted.tolist() == [3, 1, 0]
    assert got.tokens[0].tolist() == [1, 2, 3, 4]  # all accepted, then the bonus
    assert got.tokens[1, :2].tolist() == [1, 2]  # the correction at index 1
    assert got.tokens[2, 0].item() == 1


def _simulate(p: torch.Tensor, q: torch.Tensor, k: int, rows: int, length: int, seed: int):
    """``rows`` independent streams, each made by rounds of: K proposals drawn from ``q``, the
    rejection rule against ``p`` (fixed tables: a target whose next-token distribution is
    ``p`` whatever the prefix); the first ``length`` tokens of each stream."""
    gen = torch.Generator().manual_seed(seed)
    v = p.numel()
    streams = [[] for _ in range(rows)]
    for _ in range(length):  # every round emits at least one token
        proposed = torch.multinomial(q.expand(rows * k, v), 1, True, generator=gen).view(rows, k)
        uniform = torch.rand(rows, k, generator=gen)
        noise = torch.empty(rows, v).exponential_(generator=gen)
        got = accept_sampled(
            proposed, p.expand(rows, k + 1, v), q.expand(rows, k, v), uniform, noise
        )
        for s, n, toks in zip(streams, got.accepted.tolist(), got.tokens.tolist()):
            s.extend(toks[: n + 1])
    return [tuple(s[:length]) for s in streams]


@pytest.mark.parametrize(
    "p,q",
    [
        ([0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]),
        ([0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]),  # target top-k: never a filtered token
        ([0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.5, 0.5]),  # draft narrower than the target
    ],
)
def test_rejection_rule_gives_the_target_distribution(p, q):
    """K=2, so a stream's first 3 tokens include the bonus token (all accepted) as often as
    the first round accepts both proposals; 30000 streams, chi-square over the 64 cells."""
    p, q, length, rows = torch.tensor(p), torch.tensor(q), 3, 30000
    streams = _simulate(p, q, 2, rows, length, seed=0)
    counts: dict = {}
    for s in streams:
        counts[s] = counts.get(s, 0) + 1
    cells = [(a, b, c) for a in range(4) for b in range(4) for c in range(4)]
    probs = {c: float(p[c[0]] * p[c[1]] * p[c[2]]) for c in cells}
    stat, df = chi_square(counts, probs, rows)
    assert stat < critical(df), (stat, df)


def test_ngram_lookup():
    look = dict(lookup_max=3, lookup_min=1)
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3], 2, **look) == [9, 1]  # after "1 2 3"
    assert propose_ngram([1, 2, 7, 5, 2, 8, 1, 2], 3, **look) == [7, 5, 2]  # "1 2": most recent
    assert propose_ngram([4, 5, 5, 6, 5], 2, **look) == [6, 5]  # "5": the most recent one
    assert propose_ngram([3, 1, 2, 1, 2], 4, **look) == [1, 2, 1, 2]  # a period runs on
    assert propose_ngram([7, 7], 3, **look) == [7, 7, 7]
    assert propose_ngram([1, 2, 3], 2, **look) is None and propose_ngram([5], 2, **look) is None
    assert propose_ngram([1, 2, 9, 2], 2, lookup_max=3, lookup_min=2) is None  # "2" too short


# -- end to end, tp 1 (eager CPU) ---------------------------------------------------------------


def _target():
    from neuron_tp.job.presets import build_model

    return peaked(build_model("tiny-llama", 257, 4)).eval()


def _drafts(full) -> dict:
    from neuron_tp.job.presets import build_model

    return {
        "self": full,
        "first_layer": first_layers(full, 1),
        "random": peaked(build_model("tiny-gpt2", 257, 9)).eval(),
    }


def _greedy_requests(seed: int, n: int) -> list:
    return [Req(r.prompt, r.new, Sampling()) for r in make_requests(seed, n, 20, 10)]


def _trace(model, draft, reqs, seed: int, eos, **shape) -> tuple[list, dict]:
    gen = SpeculativeGenerator(model, draft, 4, max_len=40, k=3, chunk=8, **shape)
    got = run_schedule(gen, reqs, seed, eos)
    s = gen.stats
    return got, {"accepted": s.accepted, "proposed": s.proposed, "per_step": s.tokens_per_step}


def test_greedy_equals_plain_decoding_tp1():
    full = _target()
    reqs = _greedy_requests(1, 10)
    want, eos = [reference(full, r) for r in reqs], eos_ids(full)
    stats = {}
    for name, draft in _drafts(full).items():
        got, stats[name] = _trace(full, draft, reqs, 1, eos, decode_buckets=[2, 4])
        assert got == want, name
    assert stats["self"]["accepted"] == stats["self"]["proposed"] > 0
    assert stats["self"]["per_step"] == 4.0  # K + 1
    assert stats["random"]["per_step"] < stats["first_layer"]["per_step"] < 4.0
    assert 0 < stats["first_layer"]["accepted"] < stats["first_layer"]["proposed"]


def _repetitive_requests(seed: int, n: int) -> list:
    """Greedy requests whose prompts repeat a few short phrases (text an n-gram lookup suits)."""
    import random

    rng = random.Random(seed)
    phrases = [[rng.randrange(1, 256) for _ in range(rng.randint(2, 4))] for _ in range(4)]
    reqs = []
    for _ in range(n):
        prompt = [t for _ in range(rng.randint(2, 6)) for t in rng.choice(phrases)]
        reqs.append(Req(prompt[:20], rng.randint(4, 12), Sampling()))
    return reqs


def test_ngram_greedy_equals_plain_decoding_tp1():
    """Prompt lookup on repetitive prompts under a random schedule: the tokens of plain
    greedy decoding (transformers per request), some proposals accepted."""
    full = _target()
    reqs = _repetitive_requests(3, 8)
    gen = NgramGenerator(full, 4, max_len=40, k=3, chunk=8, decode_buckets=[2, 4])
    assert run_schedule(gen, reqs, 3, eos_ids(full)) == [reference(full, r) for r in reqs]
    s = gen.stats
    print(f"ngram: {s.accepted}/{s.proposed} accepted, {s.tokens_per_step:.2f} tokens/step")
    assert 0 < s.accepted < s.proposed


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_sampled_end_to_end_follows_the_target(proposer):
    """Prompt [1, 2] of a 4-token-vocabulary model, 3 new tokens at temperature 1.3, K=2,
    proposals from a draft of random weights or from the n-gram lookup (a one-hot proposal
    distribution): 480 seeded requests on 24 slots vs the exact distribution of the 64
    continuations (the rule itself is tested with 30,000 streams on tables above)."""
    from neuron_tp.job.presets import build_model

    full = peaked(build_model("tiny-llama", 4, 4), 4.0).eval()
    if proposer == "draft":
        draft = peaked(build_model("tiny-llama", 4, 11), 4.0).eval()
        gen = SpeculativeGenerator(full, draft, 24, max_len=8, k=2, chunk=4)
    else:
        gen = NgramGenerator(full, 24, max_len=8, k=2, chunk=4)
    prompt, total, temperature = [1, 2], 480, 1.3
    counts: dict = {}
    with torch.no_grad():
        for first in range(0, total, gen.slots):
            out = {}
            for i in range(gen.slots):
                slot = gen.acquire()
                sampling = Sampling(True, temperature, 0, seed=first + i)
                out[slot] = [gen.prefill(slot, prompt, 0, sampling)]
            while any(len(t) < 3 for t in out.values()):
                for slot, new in gen.decode().items():
                    out[slot] += new
            for slot, toks in out.items():
                key = tuple(toks[:3])
                counts[key] = counts.get(key, 0) + 1
                gen.release(slot)
    stat, df = chi_square(counts, exact_sequences(full, prompt, 3, temperature), total)
    assert stat < critical(df), (stat, df, gen.stats)
    assert 0 < gen.stats.accepted < gen.stats.proposed


# -- refusals -------------------------------------------------------------------------------------


def _save(path, vocab: int, *, tokenizer: str | None = None, name: str = "tiny-llama") -> str:
    from neuron_tp.job.presets import build_model

    build_model(name, vocab, 0).save_pretrained(path)
    if tokenizer is not None:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab_map = {f"{tokenizer}{i}": i for i in range(vocab)}
        tok = Tokenizer(models.WordLevel(vocab_map, unk_token=f"{tokenizer}0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return str(path)


def test_refusals(tmp_path):
    from neuron_tp.cli.args import generate_parser, serve_parser
    from neuron_tp.infer.load import check_draft
    from neuron_tp.job.config import GenerateConfig

    def config(*argv) -> GenerateConfig:
        return GenerateConfig.from_args(generate_parser().parse_args(list(argv)))

    a = _save(tmp_path / "a", 64, tokenizer="a")
    b = _save(tmp_path / "b", 80, tokenizer="a")
    c = _save(tmp_path / "c", 64, tokenizer="c")
    with pytest.raises(UserError, match=rf"--draft-model {b} has a vocabulary of 80 .*{a} has 64"):
        check_draft(config("--model", a, "--draft-model", b), 64)
    with pytest.raises(UserError, match=rf"--draft-model {c} has another tokenizer .*{a}"):
        check_draft(config("--model", a, "--draft-model", c), 64)
    check_draft(config("--model", a, "--draft-model", a), 64)  # the same: accepted
    with pytest.raises(UserError, match="--speculation-length 7 leaves no room .* 8 positions"):
        check_draft(config("--model", a, "--draft-model", a, "--speculation-length", "7"), 8)
    for parser in (generate_parser, serve_parser):
        with pytest.raises(SystemExit):
            parser().parse_args(["--draft-model", a, "--speculation-length", "0"])
    from neuron_tp.infer.speculation_setup import check_speculation_options

    refused = {
        "drop --draft-model": ["--draft-model", a, "--speculation-method", "ngram"],
        "draft needs --draft-model": ["--speculation-method", "draft"],
        "--prompt-lookup-min 3 and --prompt-lookup-max 2.*1 <= min <= max": [
            "--speculation-method=ngram",
            "--prompt-lookup-min=3",
            "--prompt-lookup-max=2",
        ],
        "--speculation-length 9 leaves no room": [
            "--speculation-method",
            "ngram",
            "--speculation-length",
            "9",
        ],
    }
    for match, argv in refused.items():
        with pytest.raises(UserError, match=match):
            check_speculation_options(config("--model", a, *argv), 8)
    check_speculation_options(config("--model", a, "--speculation-method", "ngram"), 8)
    full = _target()
    with pytest.raises(UserError, match=">= 1"):
        SpeculativeGenerator(full, full, 2, max_len=16, k=0)
    from neuron_tp.job.presets import build_model

    other = build_model("tiny-llama", 300, 0)
    with pytest.raises(UserError, match=r"vocabulary \(300 tokens\) differs .* \(257\)"):
        SpeculativeGenerator(full, other, 2, max_len=16, k=2)
    # generate refuses before loading any weight: the draft's vocabulary, from configs only
    argv = ["--device", "cpu", "--model", a, "--draft-model", b, "--prompt", "a1"]
    from neuron_tp.infer.generate_command import run_cli

    with pytest.raises(UserError, match="vocabulary of 80"):
        run_cli(generate_parser().parse_args(argv))


# -- tp 2 on gloo, tp 1 and 2 on XLA CPU devices --------------------------------------------------


def _gloo(tmp: str) -> None:
    import copy

    import engine_cases as ec

    from neuron_tp import hf, init_mesh
    from neuron_tp.cli.args import generate_parser
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.generate_command import run_cli
    from neuron_tp.job.data import ByteTokenizer

    mesh = init_mesh(tp=2)
    full = _target()
    reqs = _greedy_requests(2, 10)
    res = {"trace": {}}
    for name, draft in _drafts(full).items():
        model = hf.parallelize(copy.deepcopy(full), mesh).eval()
        d = model if name == "self" else hf.parallelize(copy.deepcopy(draft), mesh).eval()
        got, stats = _trace(model, d, reqs, 2, eos_ids(full), decode_buckets=[1, 4])
        res["trace"][name] = {"tokens": got, **stats}
    model = hf.parallelize(copy.deepcopy(full), mesh).eval()
    gen = NgramGenerator(model, 4, max_len=40, k=3, chunk=8, decode_buckets=[1, 4])
    res["ngram"] = run_schedule(gen, _repetitive_requests(3, 8), 3, eos_ids(full))
    # one kv head at tp 2: the target's and the draft's caches split by sequence
    kv1 = kv1_llama()
    model = hf.parallelize(copy.deepcopy(kv1), mesh).eval()
    twin = hf.parallelize(copy.deepcopy(kv1), mesh).eval()  # the same weights, its own cache
    got, stats = _trace(model, twin, reqs, 4, eos_ids(kv1), kv_split="sequence")
    res["split"] = {"tokens": got, **stats}
    model = hf.parallelize(copy.deepcopy(kv1), mesh).eval()
    gen = NgramGenerator(model, 4, max_len=40, k=3, chunk=8, kv_split="sequence")
    res["split_ngram"] = run_schedule(gen, _repetitive_requests(3, 8), 5, eos_ids(kv1))
    # the serving engine (leases every 3 steps), greedy requests with EOS and cancellations
    model = hf.parallelize(copy.deepcopy(full), mesh).eval()
    d = hf.parallelize(first_layers(full, 1), mesh).eval()
    engine = Engine(mesh.group("world"), lease_steps=3)
    engine.attach(SpeculativeGenerator(model, d, k=3, **ec.SHAPES), ByteTokenizer(), ec.EOS, 12)
    engine.warmup()
    if mesh.rank == 0:
        items = [dict(it, sampling=None) for it in ec.make_trace(3, 24)]
        engine.start()
        try:
            results = ec.drive(engine, items)
        finally:
            engine.shutdown(60)
        ec.check(results, items, [ec.reference(full, it) for it in items])
        res["engine"] = vars(engine.speculation()) | {"max_batch": engine.stats["max_batch"]}
    else:
        engine.follow()
    argv = ["--device", "cpu", "--tp", "2", "--prompt", "The old", "--prompt", "hi"]
    argv += ["--max-new-tokens", "9", "--buckets", "8", "--ignore-eos"]
    res["cli_plain"] = run_cli(generate_parser().parse_args(argv))
    argv += ["--draft-model", "tiny-gpt2", "--speculation-length", "3"]
    res["cli_draft"] = run_cli(generate_parser().parse_args(argv))
    argv[-4:] = ["--speculation-method", "ngram", "--speculation-length", "3"]
    res["cli_ngram"] = run_cli(generate_parser().parse_args(argv))
    with open(f"{tmp}/spec-{mesh.rank}.json", "w") as fh:
        json.dump(res, fh)


def test_greedy_equals_plain_decoding_tp2_gloo(tmp_path):
    gloo_dist.run(_gloo, str(tmp_path), world_size=2)
    reps = [json.loads((tmp_path / f"spec-{r}.json").read_text()) for r in range(2)]
    full = _target()
    want = [reference(full, r) for r in _greedy_requests(2, 10)]
    for rep in reps:
        for name, got in rep["trace"].items():
            assert got["tokens"] == want, name
        assert rep["trace"]["self"]["accepted"] == rep["trace"]["self"]["proposed"]
        assert rep["cli_draft"] == rep["cli_plain"] == rep["cli_ngram"]
        assert rep["ngram"] == [reference(full, r) for r in _repetitive_requests(3, 8)]
        # split by sequence (a twin of the model drafting: every proposal accepted only if
        # the draft's split cache and attention are right too)
        kv1 = kv1_llama()
        assert rep["split"]["tokens"] == [reference(kv1, r) for r in _greedy_requests(2, 10)]
        assert rep["split"]["accepted"] == rep["split"]["proposed"] > 0
        assert rep["split_ngram"] == [reference(kv1, r) for r in _repetitive_requests(3, 8)]
    engine = reps[0]["engine"]
    assert engine["max_batch"] == 3 and 0 < engine["accepted"] < engine["proposed"], engine


def test_xla_devices_replayed_graphs():
    """tp 2 on 2 XLA CPU devices, replayed graphs: greedy requests of a random schedule equal
    transformers, sampled ones agree between the ranks; warm-up captured all 5 graphs (target
    prefill greedy + sampled, draft prefill, speculative step greedy + sampled) and the
    schedule compiles nothing more."""
    import xla_speculative_cases

    import xla_dist

    tp = 2
    res = xla_dist.run(xla_speculative_cases.job, tp, 16, 6, devices=tp)
    print(res[0]["seconds"])
    reqs = xla_speculative_cases.requests(16, 6)
    full = _target()
    for i, r in enumerate(reqs):
        if not r.sampling.do_sample:
            assert res[0]["tokens"][i] == reference(full, r), i
    assert all(r["tokens"] == res[0]["tokens"] for r in res)
    (traces, compiles), (traces_after, compiles_after) = res[0]["counts"]
    assert traces == traces_after == 5 and compiles == compiles_after, res[0]["counts"]
    assert 0 < res[0]["accepted"] < res[0]["proposed"], res[0]


def test_metrics_report_the_acceptance():
    from neuron_tp.infer.metrics import ServerMetrics
    from neuron_tp.infer.speculative import SpeculationStats

    stats = SpeculationStats(4, steps=3, row_steps=5, proposed=20, accepted=15, tokens=20)
    found = {}
    for source in (lambda: stats, lambda: None):
        body, _ = ServerMetrics(lambda: 0, lambda: 0, speculation=source).render(None)
        lines = [ln.split() for ln in body.decode().splitlines() if ln.startswith("neuron_tp_spec")]
        found[source() is None] = {name: float(v) for name, v in lines}
    assert found[False] == {
        "neuron_tp_speculation_proposed_tokens": 20.0,
        "neuron_tp_speculation_accepted_tokens": 15.0,
        "neuron_tp_speculation_acceptance_ratio": 0.75,
        "neuron_tp_speculation_tokens_per_step": 4.0,
    }
    assert set(found[True].values()) == {0.0}


def test_server_with_a_draft_answers_as_without_and_reports_acceptance():
    """``serve --draft-model``'s loading (serve_command.load_engine) and HTTP: greedy
    completions equal the model's own greedy tokens (static Generator), /metrics counts the
    proposals."""
    from starlette.testclient import TestClient

    from neuron_tp import init_mesh
    from neuron_tp.cli.args import serve_parser
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.serve_command import load_engine as _load
    from neuron_tp.infer.server import create_app
    from neuron_tp.infer.static_generator import generate
    from neuron_tp.job.config import ServeConfig

    argv = ["--device", "cpu", "--buckets", "8", "--max-new-tokens", "12"]
    argv += ["--batch-buckets", "1,2", "--draft-model", "tiny-gpt2", "--speculation-length", "3"]
    engine = Engine()
    _load(engine, ServeConfig.from_args(serve_parser().parse_args(argv)), init_mesh(tp=1))
    assert isinstance(engine.gen, SpeculativeGenerator) and engine.gen.k == 3
    engine.start()
    want = generate(engine.gen.model, [[72, 105, 32]], 12, [8])[0]
    with TestClient(create_app(engine, "x")) as c:
        r = c.post(
            "/v1/completions", json={"prompt": [72, 105, 32], "max_tokens": 12, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        metrics = c.get("/metrics").text
    engine.shutdown(5)
    assert text == engine.tokenizer.decode([t for t in want if t not in engine.eos_ids])
    proposed = [ln for ln in metrics.splitlines() if ln.startswith("neuron_tp_speculation_prop")]
    assert proposed and float(proposed[0].split()[1]) > 0, metrics

"""Per-row sampling parameters as data, log-probabilities, echo, ``n`` and stops, against
references written here and in tests/infer/sampling_cases.py in plain torch on transformers'
logits of the same tiny random weights: the engine at tp 1, tp 2 on gloo ranks and tp 2 on two
XLA CPU devices (no graph compiled after warm-up), and ``neuron-tp serve``'s OpenAI formats
through the ``openai`` client (completions and chat logprobs, lm-eval's echo request, ``n``,
many stop strings, stop token ids, the default ``max_tokens``, generation_config defaults,
streamed log-probabilities) and the refusals of a speculative generator."""

from __future__ import annotations

import copy

import openai
import pytest
import sampling_cases as sc
import torch

import gloo_dist
from http_app import free_port as _free_port
from http_app import listen as _listen


def test_top_p_min_p_top_k_draw_inside_their_set_with_the_renormalised_distribution():
    """The in-graph filters over 40,000 Gumbel-max draws of one row: only tokens of the
    reference's allowed set, each with its renormalised probability (chi-square)."""
    from neuron_tp.infer.sampling import ROW_PARAMS, Sampling, choose_adjusted, host_noise

    torch.manual_seed(0)
    logits = torch.randn(1, 64)
    for s in (
        Sampling(True, 1.0, 0, 1, top_p=0.7),
        Sampling(True, 0.8, 0, 2, min_p=0.05),
        Sampling(True, 1.2, 12, 3, top_p=0.9, min_p=0.02),
    ):
        n = 40_000
        noise = host_noise(torch.Generator().manual_seed(s.seed), n, 64)
        params = torch.tensor([s.row_params()] * n)
        rows = (torch.full((n,), s.temperature), torch.full((n,), s.top_k), params)
        rows += (torch.zeros(n, 64), torch.zeros(n, 64), torch.zeros(n, 64))
        drawn = choose_adjusted(logits.expand(n, 64), rows, torch.ones(n, dtype=torch.bool), noise)
        keep = sc.allowed(logits[0].double(), s)
        assert set(drawn.tolist()) <= keep, (s, set(drawn.tolist()) - keep)
        assert len(keep) > 2 and ROW_PARAMS[0] == "top_p"
        probs = torch.softmax(logits[0].double() / s.temperature, -1)
        order = sorted(keep)
        p = probs[order] / probs[order].sum()
        counts = torch.bincount(drawn, minlength=64)[order].double()
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        # 99.9% quantile of chi-square with len(keep) - 1 degrees of freedom (Wilson-Hilferty)
        k = len(keep) - 1
        bound = k * (1 - 2 / (9 * k) + 3.09 * (2 / (9 * k)) ** 0.5) ** 3
        assert chi2 < bound, (s, chi2, bound)


def _engine(full, group=None, **kw):
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.slot_generator import SlotGenerator
    from neuron_tp.job.data import ByteTokenizer

    engine = Engine(group, **kw)
    engine.attach(SlotGenerator(full, **sc.SHAPES), ByteTokenizer(), sc.EOS, sc.LIMIT)
    return engine


@pytest.fixture(scope="module")
def full():
    return sc.full_model()


@pytest.fixture(scope="module")
def served(full):
    """(engine, base url) of an in-process tp=1 server of the peaked tiny model."""
    from neuron_tp import hf, init_mesh
    from neuron_tp.infer.server import create_app

    model = hf.parallelize(copy.deepcopy(full), init_mesh(tp=1)).eval()
    engine = _engine(model)
    engine.warmup(every_shape=True)
    engine.start()
    port = _free_port()
    stop = _listen(create_app(engine, "tiny"), port)
    yield engine, f"http://127.0.0.1:{port}"
    stop()
    engine.shutdown(10)


def test_engine_tp1_every_parameter_as_data_in_one_batch(full, served):
    engine, _ = served
    items = sc.with_stop_ids(full, sc.cases())
    forked = engine.rows.forked
    result = sc.check(full, items, sc.run(engine, items))
    assert engine.rows.forked == forked + 1  # the second choice of LONG copied the first's KV
    print(f"largest log-probability error {result['worst']:.2e}")


def _tp2_gloo(case: str) -> None:
    from neuron_tp import hf, init_mesh

    mesh = init_mesh(tp=2)
    full = sc.full_model()
    items = sc.with_stop_ids(full, sc.cases())
    model = hf.parallelize(copy.deepcopy(full), mesh).eval()
    engine = _engine(model, mesh.group("world"), lease_steps=3)
    engine.warmup()
    if mesh.rank != 0:
        engine.follow()
        assert engine.rows.forked == 1  # every rank copies the sibling's KV
        return
    engine.start()
    try:
        results = sc.run(engine, items)
    finally:
        engine.shutdown(60)
    sc.check(full, items, results)
    assert engine.rows.forked == 1


def test_engine_tp2_gloo():
    gloo_dist.run_case(_tp2_gloo, "cases", cases=["cases"], world_size=2)


def test_engine_tp2_on_two_xla_devices_compiles_nothing_after_warmup(full):
    import xla_dist

    r0, r1 = xla_dist.run(sc.xla_job, 2, devices=2)
    for r in (r0, r1):
        assert r["traces"][0] == r["traces"][1] == 17, r["traces"]
        assert r["forked"] == 1
    assert r0["compiles"][0] == r0["compiles"][1], r0["compiles"]
    result = sc.check(full, r0["items"], r0["results"])
    print(f"XLA tp2: largest log-probability error {result['worst']:.2e}, {r0['seconds']:.1f} s")


# -- the HTTP API ----------------------------------------------------------------------------------


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _text(ids: list[int]) -> str:
    from neuron_tp.job.data import ByteTokenizer

    return ByteTokenizer().decode(ids)


def test_completions_logprobs_in_openai_legacy_format(full, served):
    _, url = served
    r = _client(url).completions.create(
        model="tiny", prompt=sc.PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    (choice,) = r.choices
    lp = choice.logprobs
    out = sc.greedy_reference(full, sc.PROMPT, 6, sc.Sampling())
    ref = sc.logits_of(full, sc.PROMPT + out).log_softmax(-1)[len(sc.PROMPT) - 1 :]
    assert lp.tokens == [_text([t]) for t in out] and choice.text == _text(out)
    for k, t in enumerate(out):
        assert abs(lp.token_logprobs[k] - float(ref[k, t])) < sc.LP_TOL
        top = ref[k].topk(3)
        want = {_text([i]): float(v) for i, v in zip(top.indices.tolist(), top.values)}
        assert lp.top_logprobs[k].keys() == want.keys()
        assert all(abs(lp.top_logprobs[k][w] - want[w]) < sc.LP_TOL for w in want)
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:k]) for k in range(len(out))]


def test_lm_eval_loglikelihood_request_echo_logprobs(full, served):
    """lm-eval's loglikelihood call: token ids, ``echo``, ``logprobs: 1``, ``max_tokens: 1``
    (and 0): the prompt's log-probabilities, the first null, within 2e-3 of transformers."""
    _, url = served
    prompt = sc.LONG  # 3 prefill chunks
    ref = sc.logits_of(full, prompt).log_softmax(-1)
    client = _client(url)
    for n in (1, 0):
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=n, temperature=0, logprobs=1, echo=True, seed=1
        )
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(_text(prompt)) and len(lp.tokens) == len(prompt) + n
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for k in range(1, len(prompt)):
            assert abs(lp.token_logprobs[k] - float(ref[k - 1, prompt[k]])) < sc.LP_TOL, k
            greedy = int(ref[k - 1].argmax()) == prompt[k]  # lm-eval's is_greedy
            assert greedy == (lp.token_logprobs[k] == max(lp.top_logprobs[k].values())), k
        assert r.usage.completion_tokens == n and r.usage.prompt_tokens == len(prompt)
    # echo without logprobs: the prompt's text in front, no log-probabilities
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0)
    assert r.choices[0].text == "Hi" + plain.choices[0].text and r.choices[0].logprobs is None


def test_chat_logprobs_content_entries(full, served):
    engine, url = served
    from neuron_tp.infer.completion_request import chat_prompt, encode_prompt

    messages = [{"role": "user", "content": "hi"}]
    r = _client(url).chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    ids = encode_prompt(engine.tokenizer, chat_prompt(engine.tokenizer, messages), chat=True)
    out = sc.greedy_reference(full, ids, 5, sc.Sampling())
    ref = sc.logits_of(full, ids + out).log_softmax(-1)[len(ids) - 1 :]
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [_text([t]) for t in out]
    for k, (c, t) in enumerate(zip(content, out)):
        assert abs(c.logprob - float(ref[k, t])) < sc.LP_TOL and c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 2
        assert [a.token for a in c.top_logprobs] == [_text([i]) for i in ref[k].topk(2).indices]
    streamed = _client(url).chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, stream=True
    )
    tokens = [c.token for ch in streamed for c in (ch.choices[0].logprobs or _none).content or []]
    assert tokens == [c.token for c in content]


def test_chat_echo_and_continue_final_message(full, served):
    """vLLM's chat ``echo`` with ``continue_final_message``: the assistant's unfinished
    message goes on (transformers' greedy tokens after it) and leads the answer, whole and
    streamed; after a user turn an assistant answer echoes nothing; the refusals."""
    import os

    from transformers import AutoTokenizer

    from neuron_tp.infer.completion_request import chat_prompt, encode_prompt

    engine, url = served
    client = _client(url)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    kw = dict(model="tiny", messages=messages, max_tokens=5, temperature=0)
    turn = {"add_generation_prompt": False, "continue_final_message": True}
    text = chat_prompt(engine.tokenizer, messages, add_generation_prompt=False, continue_final=True)
    out = sc.greedy_reference(
        full, encode_prompt(engine.tokenizer, text, chat=True), 5, sc.Sampling()
    )
    want = _text([t for t in out if t not in sc.EOS])
    plain = client.chat.completions.create(**kw, extra_body=turn).choices[0].message
    echoed = client.chat.completions.create(**kw, extra_body={**turn, "echo": True})
    assert plain.content == want and echoed.choices[0].message.content == "Hel" + want
    assert echoed.choices[0].message.role == "assistant" and text.endswith("assistant: Hel")
    chunks = client.chat.completions.create(**kw, stream=True, extra_body={**turn, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hel" + want
    asked = dict(model="tiny", messages=messages[:1], max_tokens=4, temperature=0)
    assert (
        client.chat.completions.create(**asked, extra_body={"echo": True}).choices[0].message
        == client.chat.completions.create(**asked).choices[0].message
    )
    for body, param in (
        ({"continue_final_message": True}, "continue_final_message"),  # with the turn opened
        ({"add_generation_prompt": 1}, "add_generation_prompt"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**kw, extra_body=body)
        assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError, match="the last message to be the assistant"):
        client.chat.completions.create(**asked, extra_body=turn)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    hf = AutoTokenizer.from_pretrained(os.path.join(repo, "examples", "sft", "tokenizer"))
    rendered = chat_prompt(hf, messages, add_generation_prompt=False, continue_final=True)
    assert rendered.rstrip().endswith("Hel"), rendered


class _none:
    content = None


def test_penalties_bias_and_top_p_through_the_api(full, served):
    engine, url = served
    client = _client(url)
    s = sc.Sampling(presence_penalty=0.8, frequency_penalty=0.6, logit_bias=((72, 2.5),))
    r = client.completions.create(
        model="tiny",
        prompt=sc.PROMPT,
        max_tokens=sc.MAX_NEW,
        temperature=0,
        presence_penalty=0.8,
        frequency_penalty=0.6,
        logit_bias={"72": 2.5},
    )
    want = sc.greedy_reference(full, sc.PROMPT, sc.MAX_NEW, s)
    assert r.choices[0].text == _text([t for t in want if t not in sc.EOS])
    assert want != sc.greedy_reference(full, sc.PROMPT, sc.MAX_NEW, sc.Sampling())
    # sampled: the request's parameters reach its row (the same tokens as the engine's own
    # request with that Sampling; the engine's draws are checked against the reference sets
    # in sampling_cases)
    r = client.completions.create(
        model="tiny", prompt=sc.PROMPT, max_tokens=8, temperature=1.0, top_p=0.6, seed=5,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.1},
    )  # fmt: skip
    s = sc.Sampling(True, 1.0, 0, 5, top_p=0.6, min_p=0.1, repetition_penalty=1.3)
    item = dict(kind="allowed", prompt=sc.PROMPT, max_tokens=8, sampling=s, output=sc.Output())
    (direct,) = sc.run(engine, [item])
    sc.check(full, [item], [direct])
    assert r.choices[0].text == _text([t for t in direct["tokens"] if t not in sc.EOS])


def test_n_choices_stop_strings_and_stop_token_ids(full, served):
    _, url = served
    client = _client(url)
    kw = dict(model="tiny", prompt=["Hello", "abc"], max_tokens=8, temperature=1.1, seed=9)
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    alone = [
        client.completions.create(**{**kw, "prompt": p, "seed": 9 + j})
        for p in ("Hello", "abc")
        for j in range(3)
    ]
    texts = [a.choices[0].text for a in alone]
    assert [c.text for c in r.choices] == texts and len(set(texts[:3])) > 1
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    greedy = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=0, n=2
    )
    assert greedy.choices[0].text == greedy.choices[1].text
    full_text = greedy.choices[0].text
    stops = [f"never{i}" for i in range(7)] + [full_text[3:5]]
    r = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=0, stop=stops
    )
    assert r.choices[0].text == full_text[: full_text.index(full_text[3:5])]
    assert r.choices[0].finish_reason == "stop"
    ids = sc.greedy_reference(full, sc.LONG, 8, sc.Sampling())
    k = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k])
    r = client.completions.create(
        model="tiny", prompt=sc.LONG, max_tokens=8, temperature=0,
        extra_body={"stop_token_ids": [ids[k]]},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1
    assert r.choices[0].text == _text(ids[:k])


def test_best_of_answers_the_candidates_of_highest_cumulative_logprob(full, served):
    """``best_of`` 3, ``n`` 2 over two token-id prompts: of each prompt's 3 candidates (the
    choices of ``n`` 3 with the same seed), the 2 whose tokens transformers gives the highest
    summed log-probability, best first; the candidates share their prompt's prefill."""
    engine, url = served
    client = _client(url)
    ascii_only = {str(t): -100 for t in range(128, sc.VOCAB)}  # text -> ids is exact
    prompts = [sc.LONG, sc.PROMPT]
    kw = dict(model="tiny", prompt=prompts, max_tokens=6, temperature=1.0, seed=21)
    every = client.completions.create(n=3, logit_bias=ascii_only, **kw).choices
    forked = engine.rows.forked
    best = client.completions.create(n=2, best_of=3, logprobs=0, logit_bias=ascii_only, **kw)
    assert engine.rows.forked == forked + 4  # two candidates of each prompt copied its KV
    want, scores = [], []
    for i, prompt in enumerate(prompts):
        ref = []
        for c in every[3 * i : 3 * i + 3]:
            ids = list(c.text.encode())
            lp = sc.logits_of(full, prompt + ids).log_softmax(-1)[len(prompt) - 1 :]
            ref.append(sum(float(lp[k, t]) for k, t in enumerate(ids)))
        order = sorted(range(3), key=lambda j: -ref[j])
        assert ref[order[1]] - ref[order[2]] > 10 * sc.LP_TOL  # no near tie
        want += [every[3 * i + j].text for j in order[:2]]
        scores += [ref[j] for j in order[:2]]
    assert [c.text for c in best.choices] == want and len(set(want)) == 4
    assert [c.index for c in best.choices] == [0, 1, 2, 3]
    for c, score in zip(best.choices, scores):
        assert abs(sum(c.logprobs.token_logprobs) - score) < 6 * sc.LP_TOL
    assert best.usage.completion_tokens == 2 * 3 * 6  # every candidate's tokens
    plain = client.completions.create(n=1, best_of=2, logit_bias=ascii_only, **kw)
    assert all(c.logprobs is None for c in plain.choices)  # ranked, not shown unasked


def test_default_max_tokens_is_the_room_left_and_generation_config_defaults(full, served):
    from transformers import GenerationConfig

    from neuron_tp.infer.request_params import generation_defaults

    engine, url = served
    client = _client(url)
    long = "x" * 17  # "user: ...\nassistant: ": 35 of the 40 positions of a slot
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": long}], temperature=1.0, seed=1,
        extra_body={"logit_bias": {str(e): -100 for e in sc.EOS}},
    )  # fmt: skip
    prompt = chat.usage.prompt_tokens
    assert prompt == 35 and chat.usage.completion_tokens == min(
        sc.LIMIT, sc.SHAPES["max_len"] - prompt
    )
    r = client.completions.create(
        model="tiny", prompt="y" * 33, temperature=1.0, seed=2,
        extra_body={"logit_bias": {str(e): -100 for e in sc.EOS}},
    )  # fmt: skip
    assert r.usage.completion_tokens == 40 - 33 and r.choices[0].finish_reason == "length"
    cfg = GenerationConfig(temperature=0.6, top_p=0.9, repetition_penalty=1.2, eos_token_id=3)
    assert generation_defaults(cfg) == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.2}
    assert generation_defaults(GenerationConfig()) == {}
    engine.sampling_defaults = {"repetition_penalty": 1.6}
    try:
        r = client.completions.create(model="tiny", prompt=sc.LONG, max_tokens=6, temperature=0)
        explicit = client.completions.create(
            model="tiny", prompt=sc.LONG, max_tokens=6, temperature=0,
            extra_body={"repetition_penalty": 1.0},
        )  # fmt: skip
    finally:
        engine.sampling_defaults = {}
    want = sc.greedy_reference(full, sc.LONG, 6, sc.Sampling(repetition_penalty=1.6))
    assert r.choices[0].text == _text([t for t in want if t not in sc.EOS])
    plain = sc.greedy_reference(full, sc.LONG, 6, sc.Sampling())
    assert (
        explicit.choices[0].text
        == _text([t for t in plain if t not in sc.EOS])
        != r.choices[0].text
    )


def test_streamed_completion_logprobs_equal_the_whole_answer(served):
    _, url = served
    client = _client(url)
    kw = dict(model="tiny", prompt=sc.LONG, max_tokens=5, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kw).choices[0]
    text, tokens, lps, offsets = "", [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert lps == whole.logprobs.token_logprobs and offsets == whole.logprobs.text_offset


def test_speculation_refuses_what_its_verification_does_not_apply(full):
    """A speculative generator (here n-gram) takes temperature and top_k only: the filters,
    penalties, bias and log-probabilities are refused before anything runs."""
    from neuron_tp import hf, init_mesh
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.ngram import NgramGenerator
    from neuron_tp.infer.sampling import Sampling
    from neuron_tp.infer.schedule import Output
    from neuron_tp.job.data import ByteTokenizer

    model = hf.parallelize(copy.deepcopy(full), init_mesh(tp=1)).eval()
    engine = Engine()
    gen = NgramGenerator(model, 2, 40, k=2, chunk=8, prefill_buckets=[8])
    engine.attach(gen, ByteTokenizer(), sc.EOS, sc.MAX_NEW)
    engine.check([1, 2], 4, [], Sampling(True, 0.8, 5, 1))
    for s in (
        Sampling(True, 1.0, 0, 1, top_p=0.9),
        Sampling(True, 1.0, 0, 1, min_p=0.1),
        Sampling(presence_penalty=0.5),
        Sampling(repetition_penalty=1.2),
        Sampling(logit_bias=((3, 1.0),)),
    ):
        with pytest.raises(ValueError, match="not supported with speculative decoding"):
            engine.check([1, 2], 4, [], s)
    with pytest.raises(ValueError, match="logprobs are not supported with speculative"):
        engine.check([1, 2], 4, [], Sampling(), Output(logprobs=True))
    with pytest.raises(ValueError, match="prompt log-probabilities"):
        engine.check([1, 2], 4, [], Sampling(), Output(prompt_logprobs=True))
    with pytest.raises(ValueError, match="structured outputs are not supported with speculative"):
        engine.check([1, 2], 4, [], Sampling(), Output(grammar=sc.json_grammar(None)))

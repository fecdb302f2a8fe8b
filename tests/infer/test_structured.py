"""Structured outputs and tool calls through ``neuron-tp serve``'s chat endpoint and the
``openai`` client, on the tiny random model of tests/infer/sampling_cases.py (byte tokens):
``response_format`` json_object and json_schema give valid JSON (whole and streamed); a named
``tool_choice`` and ``required`` give calls whose arguments match the function's schema
(whole and as streamed ``tool_calls`` deltas), finish reason ``tool_calls``; a second turn with
the assistant's ``tool_calls`` and the ``tool`` message goes through the chat template with
the tools; the ``hermes`` and ``llama3_json`` parsers of ``auto``. The engine tiers (tp 1, tp 2
on gloo, XLA CPU devices with no compile after warm-up) are in tests/infer/test_sampling_api.py,
the tp 2 server in tests/infer/test_server.py."""

from __future__ import annotations

import copy
import json

import jsonschema
import openai
import pytest
import sampling_cases as sc
from test_sampling_api import _client, _free_port, _listen

from neuron_tp.job.data import ByteTokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "flag",
            "parameters": {
                "type": "object",
                "properties": {"on": {"type": "boolean"}},
                "required": ["on"],
                "additionalProperties": False,
            },
        },
    },
]
SHAPES = dict(slots=2, max_len=768, chunk=128, prefill_buckets=[128], decode_buckets=[2])


class TemplateTokens(ByteTokenizer):
    """Byte tokens with a chat template (Hermes-like: the tools as JSON in a system turn),
    keeping what each rendering was given."""

    chat_template = "hermes-like"

    def __init__(self):
        self.rendered: list[tuple[list, list | None]] = []

    def apply_chat_template(
        self, messages, tools=None, tokenize=False, add_generation_prompt=False
    ):
        assert not tokenize and add_generation_prompt
        self.rendered.append((messages, tools))
        out = f"<tools>{json.dumps(tools)}</tools>\n" if tools else ""
        for m in messages:
            calls = "".join(
                f"<tool_call>{json.dumps(c['function'])}</tool_call>"
                for c in m.get("tool_calls") or []
            )
            out += f"<{m['role']}>{m['content']}{calls}\n"
        return out + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return super().encode(text)


@pytest.fixture(scope="module")
def served():
    from neuron_tp import hf, init_mesh
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.server import create_app
    from neuron_tp.infer.slot_generator import SlotGenerator

    model = hf.parallelize(copy.deepcopy(sc.full_model()), init_mesh(tp=1)).eval()
    engine = Engine(None)
    tok = TemplateTokens()
    engine.attach(SlotGenerator(model, **SHAPES), tok, sc.EOS, 96)
    engine.warmup(every_shape=True)
    engine.start()
    port = _free_port()
    stop = _listen(create_app(engine, "tiny"), port)
    client = _client(f"http://127.0.0.1:{port}")
    client._engine = engine
    yield tok, client
    stop()
    engine.shutdown(10)


def _ask(client, text: str = "hi", **kw):
    messages = kw.pop("messages", [{"role": "user", "content": text}])
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def _streamed(stream) -> tuple[str, list, str | None]:
    """Content, the tool_calls deltas and the finish reason of a stream."""
    text, calls, reason = "", [], None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reason = c.finish_reason or reason
    return text, calls, reason


def test_json_object_and_json_schema(served):
    _, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": sc.SCHEMA}}
    for kw in (
        dict(temperature=0),
        dict(temperature=1.2, seed=3),
        dict(temperature=1.0, seed=1, logit_bias={"34": 8}),  # a key: not only {}
        dict(temperature=1.0, seed=1, logit_bias={"34": 8, "215": 9}),  # an EOS byte is text too
    ):
        r = _ask(client, response_format={"type": "json_object"}, **kw)
        assert isinstance(json.loads(r.choices[0].message.content), dict), r
        assert r.choices[0].finish_reason == "stop"
        r = _ask(client, "Once", response_format=fmt, **kw)
        jsonschema.validate(json.loads(r.choices[0].message.content), sc.SCHEMA)
        assert r.choices[0].finish_reason == "stop"
    text, _, reason = _streamed(_ask(client, response_format=fmt, temperature=0.9, stream=True))
    jsonschema.validate(json.loads(text), sc.SCHEMA)
    assert reason == "stop"
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"schema": {}}}):
        with pytest.raises(openai.BadRequestError) as err:
            _ask(client, response_format=bad)
        assert err.value.body["param"] == "response_format"


def test_named_and_required_tool_calls_and_a_second_turn(served):
    tok, client = served
    named = {"type": "function", "function": {"name": "weather"}}
    for kw in (dict(temperature=0), dict(temperature=1.3, seed=5)):
        r = _ask(client, "weather?", tools=TOOLS, tool_choice=named, **kw)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert call.type == "function" and call.function.name == "weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert tok.rendered[-1][1] == TOOLS  # the tools went through the chat template
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):  # parallel_tool_calls false: the grammar allows exactly one call
        r = _ask(
            client, "which?", tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
            parallel_tool_calls=False,
        )  # fmt: skip
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])
    # parallel (the default): an array of one or more calls (a random model goes on with more
    # until max_tokens unless "]" is favoured)
    close = {str(ord("]")): 2.0}
    r = _ask(
        client, "which?", tools=TOOLS, tool_choice="required", temperature=1.0, seed=2,
        logit_bias=close,
    )  # fmt: skip
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    assert len({c.id for c in calls}) == len(calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schema[c.function.name])
    # the second turn: the assistant's call (content null) and the tool's answer in the history
    first = _ask(client, "weather?", tools=TOOLS, tool_choice=named, temperature=0)
    said = first.choices[0].message
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [c.model_dump() for c in said.tool_calls],
        },
        {"role": "tool", "tool_call_id": said.tool_calls[0].id, "content": '{"temp": 3}'},
    ]
    r = _ask(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=6, seed=1)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    messages, tools = tok.rendered[-1]
    assert tools is None and messages[2]["role"] == "tool"
    assert messages[1]["tool_calls"][0]["function"]["name"] == "weather"
    r = _ask(client, messages=history, tools=TOOLS, tool_choice=named, temperature=0)
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), WEATHER)
    assert tok.rendered[-1][1] == TOOLS


def test_streamed_tool_calls_are_deltas(served):
    _, client = served
    named = {"type": "function", "function": {"name": "weather"}}
    stream = _ask(client, tools=TOOLS, tool_choice=named, temperature=1.1, seed=9, stream=True)
    text, calls, reason = _streamed(stream)
    assert text == "" and reason == "tool_calls" and len(calls) > 1  # the arguments as they come
    assert calls[0].id and calls[0].function.name == "weather" and calls[0].type == "function"
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in calls[1:])
    jsonschema.validate(json.loads("".join(c.function.arguments for c in calls)), WEATHER)
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    close = {str(ord("]")): 2.0}  # the array of calls ends within max_tokens
    for kw in (
        dict(temperature=0, logit_bias=close),
        dict(temperature=1.2, seed=4, parallel_tool_calls=False),
    ):
        kw = dict(tools=TOOLS, tool_choice="required", **kw)
        text, deltas, reason = _streamed(_ask(client, stream=True, **kw))
        whole = _ask(client, **kw).choices[0].message.tool_calls
        assert text == "" and reason == "tool_calls" and len(deltas) > len(whole)
        calls = _joined(deltas)
        assert [c["name"] for c in calls] == [c.function.name for c in whole]
        for c, w in zip(calls, whole):
            value = json.loads(c["arguments"])
            assert value == json.loads(w.function.arguments) and c["id"]
            jsonschema.validate(value, schema[c["name"]])


def _joined(deltas) -> list[dict]:
    """The calls of streamed ``tool_calls`` deltas as a client joins them (by index): the
    first delta of each with its id, type and name, then only argument pieces."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id and d.type == "function" and d.function.name, d
            calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
        else:
            assert d.id is None and d.function.name is None, d
        calls[d.index]["arguments"] += d.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def test_streamed_auto_calls_are_deltas_as_they_are_generated(served):
    """``auto`` with the ``llama3_json`` parser, the model's text made a call by a
    ``response_format`` of the call's shape: the name first, then the arguments in pieces,
    finish reason ``tool_calls``; equal to the whole answer's call."""
    tok, client = served
    engine = client._engine
    shape = {
        "type": "object",
        "properties": {"name": {"const": "weather"}, "parameters": WEATHER},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": shape}}
    kw = dict(tools=TOOLS, response_format=fmt, temperature=1.0, seed=3)
    engine.tool_call_parser = "llama3_json"
    try:
        text, deltas, reason = _streamed(_ask(client, stream=True, **kw))
        whole = _ask(client, **kw).choices[0]
    finally:
        engine.tool_call_parser = "hermes"
    (call,) = _joined(deltas)
    assert text == "" and reason == "tool_calls" == whole.finish_reason and len(deltas) > 2
    assert call["name"] == "weather" == whole.message.tool_calls[0].function.name
    value = json.loads(call["arguments"])
    assert value == json.loads(whole.message.tool_calls[0].function.arguments)
    jsonschema.validate(value, WEATHER)


def test_call_stream_equals_the_whole_answers_parse_in_any_pieces():
    """:class:`CallStream` fed a text in random pieces: the content (up to surrounding
    whitespace) and calls of :func:`parse_calls` / :func:`forced_calls` of the whole text,
    the arguments as their pieces came; the first call only without parallel_tool_calls."""
    import random

    from neuron_tp.infer.tools import CallStream, ToolChoice, forced_calls, parse_calls

    tools = tuple(TOOLS)
    args = r'{"city": "Oslo", "x": [1, {"a": "}\\"}], "s": "a\"b"}'  # escapes, braces in strings
    weather = '{"name": "weather", "parameters": {"days": 2}}'
    cases = [
        ("hermes", f'Let me look.<tool_call>\n{{"name": "weather", "arguments": {args}}}\n'
                   "</tool_call>"),
        ("hermes", '<tool_call>{"name": "flag", "arguments": {"on": true}}</tool_call>'
                   '<tool_call>{"name": "weather", "arguments": {}}</tool_call> done'),
        ("hermes", "no call here <tool"),
        ("hermes", '<tool_call>{"name": "other", "arguments": {}}</tool_call>'),
        ("hermes", '<tool_call>{"arguments": {"on": true}, "name": "flag"}</tool_call>'),
        ("llama3_json", weather + '; {"name": "flag", "parameters": {}}'),
        ("llama3_json", "<|python_tag|>" + '{"name": "flag", "parameters": {"on": false}}'),
        ("llama3_json", " It is sunny."),
    ]  # fmt: skip
    forced = [
        (ToolChoice("required", tools), '[{"name":"weather","arguments":{"days":3}},'
                                        '{"name":"flag","arguments":{"on":true}}]'),
        (ToolChoice("required", tools, parallel=False), '{"name":"flag","arguments":{"on":true}}'),
        (ToolChoice("named", tools, "weather"), '{"city":"Paris","days":3}'),
    ]  # fmt: skip
    rng = random.Random(0)

    def fed(choice, parser, text):
        stream, content, deltas, k = CallStream(choice, parser), "", [], 0
        while k < len(text):
            n = rng.randint(1, 6)
            piece, entries = stream.feed(text[k : k + n])
            content, deltas, k = content + piece, deltas + entries, k + n
        piece, entries = stream.finish()
        return content + piece, deltas + entries

    def joined(deltas):
        calls = {}
        for d in deltas:
            if d["index"] not in calls:
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
                assert d["id"].startswith("call_") and d["type"] == "function"
            else:
                assert "id" not in d and "name" not in d["function"]
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
        return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]

    names = {"weather", "flag"}
    for parallel in (True, False):
        auto = ToolChoice("auto", tools, parallel=parallel)
        for parser, text in cases:
            for _ in range(4):
                content, deltas = fed(auto, parser, text)
                want_content, want = parse_calls(parser, text, names)
                want = [
                    (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want
                ]
                assert joined(deltas) == (want if parallel else want[:1]), (parser, text)
                assert content.strip() == (want_content or "").strip(), (parser, text, content)
    for choice, text in forced:
        for _ in range(4):
            content, deltas = fed(choice, "hermes", text)
            want = forced_calls(choice, text)
            assert content == ""
            assert joined(deltas) == [
                (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want
            ]


def test_tool_call_parsers_of_auto():
    from neuron_tp.infer.tools import parse_calls

    names = {"weather", "flag"}
    text = (
        'Let me look.<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    content, calls = parse_calls("hermes", text, names)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    two = '<tool_call>{"name": "flag", "arguments": {"on": true}}</tool_call>' * 2
    assert len(parse_calls("hermes", two, names)[1]) == 2
    assert parse_calls("hermes", "no call here", names) == ("no call here", [])
    unknown = '<tool_call>{"name": "other", "arguments": {}}</tool_call>'
    assert parse_calls("hermes", unknown, names) == (unknown, [])
    llama = '{"name": "weather", "parameters": {"days": 2}}; {"name": "flag", "parameters": {}}'
    content, calls = parse_calls("llama3_json", llama, names)
    assert content is None and [c["function"]["name"] for c in calls] == ["weather", "flag"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"days": 2}
    assert parse_calls("llama3_json", "It is sunny.", names) == ("It is sunny.", [])
    assert parse_calls("llama3_json", '{"name": "weather"', names)[1] == []


def test_the_grammar_reaches_every_rank():
    """A lease's admissions keep their grammar through the broadcast encoding."""
    from neuron_tp.infer.grammar import json_grammar
    from neuron_tp.infer.sampling import Sampling
    from neuron_tp.infer.schedule import Admission, Lease, Output, decode, encode

    output = Output(True, False, (3,), json_grammar(WEATHER))
    lease = Lease((1,), (Admission((5, 6), 4, Sampling(), ("x",), output=output),), 2)
    assert decode(encode(lease)) == lease


def test_langchain_bind_tools_and_with_structured_output(served):
    """langchain-openai's ChatOpenAI against the server: a tool bound and forced by name, a
    two-turn tool conversation, and with_structured_output's JSON schema."""
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    _, client = served
    llm = ChatOpenAI(
        model="tiny", base_url=str(client.base_url), api_key="none", temperature=0, max_retries=0
    )
    tool = TOOLS[0]["function"]
    bound = llm.bind_tools([{"type": "function", "function": tool}], tool_choice="weather")
    asked = [HumanMessage("weather in Oslo?")]
    said = bound.invoke(asked)
    (call,) = said.tool_calls
    assert call["name"] == "weather" and said.response_metadata["finish_reason"] == "tool_calls"
    jsonschema.validate(call["args"], WEATHER)
    again = bound.invoke([*asked, said, ToolMessage('{"temp": 3}', tool_call_id=call["id"])])
    jsonschema.validate(again.tool_calls[0]["args"], WEATHER)
    # streamed: the chunks add up to the call ("any" is required; one call, parallel off)
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    anyone = llm.bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=False)
    for model in (bound, anyone):
        chunks = list(model.stream(asked))
        joined = chunks[0]
        for c in chunks[1:]:
            joined = joined + c
        (call,) = joined.tool_calls
        assert len(chunks) > 4 and joined.response_metadata["finish_reason"] == "tool_calls"
        jsonschema.validate(call["args"], schema[call["name"]])
    structured = llm.with_structured_output(
        {"title": "pick", "description": "a pick", **sc.SCHEMA}, method="json_schema"
    )
    jsonschema.validate(structured.invoke("pick one"), sc.SCHEMA)


def test_a_model_vocabulary_larger_than_the_tokenizers():
    """Ids past the tokenizer's (padded embedding rows) are never allowed; the end token only
    where the grammar may end."""
    from neuron_tp.infer.grammar import Grammars, json_grammar

    guide = Grammars(ByteTokenizer(), 300, [256]).guide(json_grammar(None))
    row = guide.mask()
    assert row.shape == (300,) and (row == 0).nonzero().flatten().tolist() == [ord("{")]
    for t in b'{"a":1}':
        assert not guide.done
        guide.accept(t)
    assert guide.done and (guide.mask() == 0).nonzero().flatten().tolist() == [256]


def test_a_transformers_tokenizer_with_merged_tokens():
    """An HF fast tokenizer (byte-level BPE trained here, multi-byte tokens) through
    llguidance's HF view: random allowed tokens until the grammar is complete give JSON of the
    schema."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from neuron_tp.infer.grammar import Grammars, json_grammar

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=alphabet
    )
    raw.train_from_iterator(['{"city":"Paris","days":3}', '{"city":"Oslo","days":7}'] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")
    assert any(len(tok.decode([t])) > 2 for t in range(len(tok)))  # merged tokens
    grammars = Grammars(tok, len(tok) + 16, [tok.eos_token_id])
    rng = random.Random(0)
    for _ in range(5):
        guide, out = grammars.guide(json_grammar(WEATHER)), []
        while not guide.done:
            allowed = (guide.mask() == 0).nonzero().flatten().tolist()
            assert allowed and max(allowed) < len(tok) and tok.eos_token_id not in allowed
            out.append(rng.choice(allowed))
            guide.accept(out[-1])
        jsonschema.validate(json.loads(tok.decode(out)), WEATHER)


def test_packed_rows_unpack_to_the_bits_of_each_token():
    """``unpack_allowed`` (what the graphs do with the uploaded words) against the bits read
    one by one in Python, for random words, a vocabulary that ends inside a word, and a
    guide's :meth:`bits` (its end token allowed only where the grammar may end)."""
    import torch

    from neuron_tp.infer.grammar import Grammars, json_grammar
    from neuron_tp.infer.sampling import allowed_words, unpack_allowed

    g = torch.Generator().manual_seed(0)
    vocab = 70
    words = torch.randint(-(2**31), 2**31, (3, allowed_words(vocab)), generator=g).int()
    want = [[(int(row[t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for row in words]
    got = unpack_allowed(words, vocab)
    assert got.shape == (3, vocab) and ((got == 0).int().tolist() == want)
    assert set(got.flatten().tolist()) == {0.0, float("-inf")}
    guide = Grammars(ByteTokenizer(), 257, [256]).guide(json_grammar(None))
    bits = guide.bits()
    assert bits.dtype == torch.int32 and bits.shape == (allowed_words(257),)
    allowed = (guide.mask() == 0).nonzero().flatten().tolist()
    assert allowed == [ord("{")]

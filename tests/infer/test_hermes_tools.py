"""``tool_choice: "auto"`` end to end: ``neuron-tp serve --tp 2`` (two torchrun ranks, gloo)
on a model directory with Qwen2.5's chat template, whose greedy answer to any chat is one
Hermes call (tests/helpers/hermes_model.py, checked against transformers' ``generate``).
With the real ``openai`` client and langchain-openai's ``bind_tools``: the answer comes back as
``tool_calls`` (id, type function, name, JSON arguments) with finish reason ``tool_calls``;
without tools, or with ``tool_choice: "none"``, it is the model's text itself; the agent's next
turn (the assistant's calls with content null, then a ``tool`` message) is rendered by the
template exactly as transformers renders the same conversation with the arguments as an object;
streamed, the ``delta.tool_calls`` add up to the non-streamed call, the last chunk's finish
reason ``tool_calls``."""

from __future__ import annotations

import json
import os
import sys

import openai
import pytest
from test_server import _children, _client, _serve, _stop
from test_structured import _joined

from hermes_model import ANSWER, CALL, WEATHER_TOOL, hermes_dir
from http_app import free_port

ASK = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the directory's tokenizer, base url) of the tp=2 server."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("hermes")
    model = hermes_dir(str(tmp / "model"))
    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "neuron_tp.cli", "serve", "--model", model, "--tp", "2", "--device", "cpu",
        "--port", str(port), "--served-model-name", "tiny", "--buckets", "256,1024",
        "--prefill-chunk", "256", "--batch-buckets", "1,2", "--max-new-tokens", "24",
    ]  # fmt: skip
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1"}
    proc, url = _serve(cmd, env, tmp / "serve.log", port)
    ranks = _children(proc.pid)
    assert len(ranks) == 2
    yield AutoTokenizer.from_pretrained(model), url
    _stop(proc, ranks)


def _ask(client, messages=ASK, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def _prompt_tokens(tok, messages, tools=None) -> int:
    """The prompt's length as transformers renders and tokenizes the conversation."""
    ids = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return len(ids)


def _is_the_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 8
    assert call.function.name == CALL["name"]
    assert json.loads(call.function.arguments) == CALL["arguments"]


def test_auto_answer_is_a_tool_call_and_the_next_turn_is_rendered(served):
    tok, url = served
    client = _client(url)
    # the model's own text (no tools; tools with "none"): the Hermes call as content
    for kw in ({}, {"tools": [WEATHER_TOOL], "tool_choice": "none"}):
        r = _ask(client, **kw)
        assert r.choices[0].message.content == ANSWER and r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.tool_calls is None
    for choice in ("auto", None):  # None: the default with tools, auto
        more = {"tool_choice": choice} if choice else {}
        r = _ask(client, tools=[WEATHER_TOOL], **more)
        said = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and said.content is None, r
        (call,) = said.tool_calls
        _is_the_call(call)
        assert r.usage.prompt_tokens == _prompt_tokens(tok, ASK, [WEATHER_TOOL])
    # the agent's next turn: the call (content null) and the tool's result
    result = '{"temp_c": 3, "sky": "snow"}'
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    r = _ask(client, history, tools=[WEATHER_TOOL])
    (again,) = r.choices[0].message.tool_calls
    _is_the_call(again)
    assert again.id != call.id
    as_hf = [
        *ASK,
        {"role": "assistant", "tool_calls": [{"type": "function", "function": CALL}]},
        {"role": "tool", "content": result},
    ]
    assert r.usage.prompt_tokens == _prompt_tokens(tok, as_hf, [WEATHER_TOOL])
    bad = [*history[:1], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0]}]}]
    bad[1]["tool_calls"][0]["function"] = {"name": "weather", "arguments": "{city: Oslo"}
    with pytest.raises(openai.BadRequestError, match=r"tool_calls\[0\].function.arguments"):
        _ask(client, bad, tools=[WEATHER_TOOL])


def test_streamed_auto_call_at_tp2_adds_up_to_the_whole_answers(served):
    _, url = served
    client = _client(url)
    whole = _ask(client, tools=[WEATHER_TOOL]).choices[0].message.tool_calls
    chunks = list(_ask(client, tools=[WEATHER_TOOL], stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    (call,) = _joined(deltas)
    assert len(deltas) > 2  # the arguments as they were generated
    assert call["name"] == whole[0].function.name and call["id"].startswith("call_")
    assert json.loads(call["arguments"]) == json.loads(whole[0].function.arguments)
    assert json.loads(call["arguments"]) == CALL["arguments"]
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == "tool_calls" and not any(reasons[:-1]), reasons


def test_langchain_bind_tools_auto_and_the_next_turn(served):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    _, url = served
    llm = ChatOpenAI(
        model="tiny", base_url=url + "/v1", api_key="none", temperature=0, max_retries=0
    )
    bound = llm.bind_tools([WEATHER_TOOL])  # tool_choice: the server's default, auto
    asked = [HumanMessage(ASK[0]["content"])]
    said = bound.invoke(asked)
    (call,) = said.tool_calls
    assert call["name"] == "weather" and call["args"] == CALL["arguments"] and call["id"]
    assert said.response_metadata["finish_reason"] == "tool_calls"
    again = bound.invoke([*asked, said, ToolMessage('{"temp_c": 3}', tool_call_id=call["id"])])
    assert [c["args"] for c in again.tool_calls] == [CALL["arguments"]]
    chunks = list(bound.stream(asked))
    joined = chunks[0]
    for c in chunks[1:]:
        joined = joined + c
    (streamed,) = joined.tool_calls
    assert streamed["name"] == "weather" and streamed["args"] == CALL["arguments"]
    assert joined.response_metadata["finish_reason"] == "tool_calls"

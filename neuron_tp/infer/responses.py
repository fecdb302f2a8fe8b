"""The bodies of the server's answers in OpenAI's formats (:mod:`.server` sends them): each
choice of a completion or chat request (:class:`Answer`: text, ``echo``, log-probabilities,
tool calls, streamed deltas), which of ``best_of`` candidates are answered
(:func:`best_choices`) and the usage."""

from __future__ import annotations

from .completion_request import CompletionRequest
from .sampling import TokenLogprob
from .schedule import Done
from .tools import CallStream, forced_calls, parse_calls


class Answer:
    """How the choices of a request are written: completion or chat, with the prompt in front
    (``echo``) and log-probabilities in OpenAI's formats (completions: ``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``; chat: ``content`` entries with
    ``token``, ``logprob``, ``bytes``, ``top_logprobs``). A token's text is its own decoding;
    an entry is ``(token, logprob or None, top or None)``."""

    def __init__(
        self, tokenizer, completion: CompletionRequest, chat: bool, parser: str = "hermes"
    ):
        self.tok, self.chat, self.params = tokenizer, chat, completion.params
        n = self.params.candidates
        self.prompts = [p for p in completion.prompts for _ in range(n)]
        self.texts = [t for t in completion.texts for _ in range(n)]
        self.role = completion.role  # a chat answer's, led by its echo
        self.leads = self.texts if self.params.chat_echo else [""] * len(self.texts)
        self.offsets = [0] * len(self.prompts)  # characters of each choice's tokens so far
        tools = self.params.tools
        self.tools = tools if chat and tools is not None and tools.mode != "none" else None
        self.parser = parser
        tools = self.tools
        self.streams = [CallStream(tools, parser) if tools else None for _ in self.prompts]

    def token_text(self, token: int) -> str:
        return self.tok.decode([token], skip_special_tokens=False)

    def choice(
        self,
        i: int,
        text: str | None,
        reason: str | None,
        stream: bool,
        lps=None,
        index: int | None = None,
    ):
        """Sequence ``i`` as choice ``index`` (None: ``i``); ``lps``: its log-probability
        entries (None: none in this chunk)."""
        wanted = self.params.logprobs is not None and lps is not None
        logprobs = self.format(i, lps) if wanted else None
        if not self.chat:
            index = i if index is None else index
            return {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        if stream:
            delta, reason = self.delta(i, text, reason)
            return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        message: dict = {"role": self.role, "content": self.leads[i] + (text or "")}
        calls = self.calls(text or "", reason)
        if calls is not None:
            message, reason = {"role": "assistant", **calls}, "tool_calls"
        return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def calls(self, text: str, reason: str | None) -> dict | None:
        """``{"content", "tool_calls"}`` of a whole answer with tool calls (None: none)."""
        tools = self.tools
        if tools is None or reason != "stop":
            return None
        if tools.forced:
            return {"content": None, "tool_calls": forced_calls(tools, text)}
        content, calls = parse_calls(self.parser, text, tools.names)
        calls = calls if tools.parallel else calls[:1]
        return {"content": content, "tool_calls": calls} if calls else None

    def delta(self, i: int, text: str | None, reason: str | None) -> tuple[dict, str | None]:
        """A stream chunk's delta and finish reason: the text as content, or with tools the
        content and ``tool_calls`` deltas of :class:`~.tools.CallStream` (finish reason
        ``tool_calls`` once a call was sent)."""
        stream = self.streams[i]
        if stream is None:
            return ({"content": text} if text is not None else {}), reason
        if text is not None:
            return chat_delta(*stream.feed(text)), None
        if reason is None:
            return {}, None
        delta = chat_delta(*stream.finish())
        return delta, "tool_calls" if stream.called and reason == "stop" else reason

    def echo_entries(self, i: int, prompt: tuple[TokenLogprob, ...] = ()) -> list:
        """The prompt's entries of choice ``i``: its first token without a log-probability,
        then the model's of the others."""
        return [(self.prompts[i][0], None, None), *self.entries(prompt)]

    @staticmethod
    def entries(lps: tuple[TokenLogprob, ...]) -> list:
        return [(e.token, e.logprob, e.top) for e in lps]

    def format(self, i: int, lps: list) -> dict:
        top_n = self.params.logprobs or 0
        if self.chat:
            content = []
            for token, lp, top in lps:
                alts = [self.chat_entry(a, v) for a, v in (top or ())[:top_n]]
                content.append({**self.chat_entry(token, lp), "top_logprobs": alts})
            return {"content": content}
        tokens, token_lps, offsets = [], [], []
        tops: list[dict | None] = []
        for token, lp, top in lps:
            text = self.token_text(token)
            tokens.append(text)
            token_lps.append(lp)
            offsets.append(self.offsets[i])
            self.offsets[i] += len(text)
            if top is None:
                tops.append(None)
                continue
            best = {self.token_text(a): v for a, v in top[:top_n]}
            best.setdefault(text, lp)  # the chosen token is always there
            tops.append(best)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat_entry(self, token: int, lp: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}


def chat_delta(content: str, calls: list[dict]) -> dict:
    delta: dict = {"content": content} if content else {}
    return {**delta, "tool_calls": calls} if calls else delta


def best_choices(scores: list[float], count: int, n: int) -> list[int]:
    """The sequences answered, in choice order: of each prompt's ``count`` (consecutive), the
    ``n`` with the highest score, best first (all, in order, when ``count == n``)."""
    if count == n:
        return list(range(len(scores)))
    picked = []
    for first in range(0, len(scores), count):
        group = range(first, first + count)
        picked += sorted(group, key=lambda i: -scores[i])[:n]
    return picked


def usage_of(done: list[Done]) -> dict:
    prompt = sum(d.prompt_tokens for d in done)
    completion = sum(d.completion_tokens for d in done)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }

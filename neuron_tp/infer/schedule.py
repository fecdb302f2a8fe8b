"""The records of the serving engine (the shape of vLLM v1's typed scheduler outputs): the
engine's :class:`Request`, the :class:`Lease` rank 0 sends to every tp rank (or
:class:`Shutdown`), written to and read from ``host_broadcast`` bytes in one place
(:func:`encode`, :func:`decode`), and the events a request's client receives
(:class:`Prompt`, :class:`Delta`, :class:`Done`, :class:`Failed`)."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .lora_slots import AdapterRef, AdapterUse
from .prefix_cache import PrefixPlan
from .sampling import Sampling, TokenLogprob


@dataclass(frozen=True)
class Output:
    """What a request wants besides its text: its tokens' log-probabilities (``logprobs``),
    its prompt's (``prompt_logprobs``: every prompt token after the first), the token ids
    that end it like an EOS (``stop_ids``), the grammar its text follows (``grammar``, an
    llguidance grammar: :mod:`.grammar`) and the key of the choices of one prompt
    (``siblings``: the first of them prefilled lends its prompt's KV to the others,
    :class:`~.slot_rows.SlotRows`)."""

    logprobs: bool = False
    prompt_logprobs: bool = False
    stop_ids: tuple[int, ...] = ()
    grammar: str | None = None
    siblings: str | None = None


@dataclass(frozen=True)
class Prompt:
    """The prompt is prefilled: the log-probabilities of its tokens after the first (a
    request with ``prompt_logprobs``)."""

    logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Delta:
    """More text of a request's answer (``logprobs``: of the tokens that arrived with it, when
    the request asked for them)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Done:
    """The request ended (``finish_reason`` ``stop`` or ``length``) with this usage."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    """The request failed; ``message`` says why."""

    message: str


Event = Prompt | Delta | Done | Failed


@dataclass
class Request:
    """One sequence to generate, as rank 0's engine holds it; ``sink`` receives its events
    (called on the worker thread)."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop: list[str]
    seeded: bool
    sink: Callable[[Event], None]
    cancelled: bool = False  # the client went away (or timed out): its slot is freed
    created: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)  # generated so far (EOS included)
    output: Output = Output()
    adapter: AdapterRef | None = None  # the LoRA adapter it names (None: the base model)

    def cancel(self) -> None:
        self.cancelled = True


@dataclass(frozen=True)
class Admission:
    """What every rank needs to run an admitted request (``prefix``: the prefix-cache copies
    rank 0 planned for it, None without prefix caching; ``adapter``: its LoRA adapter and bank
    slot, None for the base model)."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    prefix: PrefixPlan | None = None
    output: Output = Output()
    adapter: AdapterUse | None = None

    @classmethod
    def of(cls, req: Request) -> Admission:
        """``req``'s admission; a sampled request without a seed gets a random one here, sent
        to every rank with the rest."""
        sampling = req.sampling
        if sampling.do_sample and not req.seeded:
            sampling = dataclasses.replace(sampling, seed=random.getrandbits(63))
        return cls(tuple(req.prompt), req.max_tokens, sampling, tuple(req.stop), output=req.output)


@dataclass(frozen=True)
class Lease:
    """The slots to free (their clients went away), the requests admitted (in order) and how
    many iterations to run before the next message."""

    cancel: tuple[int, ...]
    admit: tuple[Admission, ...]
    steps: int


@dataclass(frozen=True)
class Shutdown:
    """Every rank's loop ends."""


def encode(message: Lease | Shutdown) -> bytes:
    """``message`` as ``host_broadcast`` bytes (JSON)."""
    if isinstance(message, Shutdown):
        return json.dumps({"op": "shutdown"}).encode()
    admit = [
        {
            "prompt": list(a.prompt),
            "max_tokens": a.max_tokens,
            "sampling": asdict(a.sampling),
            "stop": list(a.stop),
            "prefix": a.prefix.to_json() if a.prefix is not None else None,
            "output": asdict(a.output),
            "adapter": a.adapter.to_json() if a.adapter is not None else None,
        }
        for a in message.admit
    ]
    body = {"op": "lease", "cancel": list(message.cancel), "admit": admit, "steps": message.steps}
    return json.dumps(body).encode()


def decode(data: bytes) -> Lease | Shutdown:
    """The message :func:`encode` wrote."""
    body = json.loads(data)
    if body["op"] == "shutdown":
        return Shutdown()
    admit = tuple(
        Admission(
            tuple(a["prompt"]),
            a["max_tokens"],
            Sampling(**a["sampling"]),
            tuple(a["stop"]),
            PrefixPlan.from_json(a["prefix"]) if a["prefix"] is not None else None,
            _output(a["output"]),
            AdapterUse.from_json(a["adapter"]) if a.get("adapter") is not None else None,
        )
        for a in body["admit"]
    )
    return Lease(tuple(body["cancel"]), admit, body["steps"])


def _output(body: dict) -> Output:
    stop_ids = tuple(body["stop_ids"])
    grammar, siblings = body.get("grammar"), body.get("siblings")
    return Output(body["logprobs"], body["prompt_logprobs"], stop_ids, grammar, siblings)

"""Self-speculation without a second model: n-gram prompt lookup (``--speculation-method
ngram``, vLLM's ``method: ngram`` with ``prompt_lookup_max`` / ``prompt_lookup_min``).

Each step the host proposes ``K`` tokens per active slot from the slot's own prompt and output
(:func:`propose_ngram`): the tokens that followed the most recent earlier occurrence of the
slot's last ``n`` tokens, ``n`` from ``lookup_max`` down to ``lookup_min``; without a match a
fixed filler (the last token, repeated). The proposals are uploaded as one ``[slots, K]``
tensor and verified by :class:`~.speculative.VerifyingGenerator`'s graph of ``K + 1`` positions
with the same acceptance rule as a draft model's: greedy rows keep the proposals the target's
argmax agrees with; sampled rows follow the rejection rule with the proposal's distribution a
one-hot (accepted with probability ``p_target(x)``, else a token drawn from ``p_target``
without ``x``), so their tokens are distributed as the target's alone.

Repetitive text (code, retrieval-augmented answers quoting their context, structured output)
accepts many tokens per step; other text accepts few, at the cost of the verify graph's
``K + 1`` positions instead of one. The host's history is the tokens every tp rank has (the
prompt and the generated tokens), so every rank proposes the same tokens: nothing new in the
engine's leases.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import UserError
from .slot_generator import SlotGenerator
from .speculative import DEFAULT_K, VerifyingGenerator

DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN = 4, 1


def check_lookup(lookup_max: int, lookup_min: int) -> None:
    """UserError unless ``1 <= lookup_min <= lookup_max``."""
    if not 1 <= lookup_min <= lookup_max:
        raise UserError(
            f"--prompt-lookup-min {lookup_min} and --prompt-lookup-max {lookup_max}: the "
            f"n-gram lengths need 1 <= min <= max"
        )


def propose_ngram(
    history: Sequence[int], k: int, *, lookup_max: int, lookup_min: int
) -> list[int] | None:
    """The ``k`` tokens that followed the most recent earlier occurrence of the last ``n``
    tokens of ``history`` (the longest ``n`` in ``lookup_min..lookup_max`` that occurs), the
    copy running on into the proposals themselves when the occurrence ends near the end (a
    period repeats); None when no suffix occurs earlier."""
    size = len(history)
    for n in range(min(lookup_max, size - 1), lookup_min - 1, -1):
        tail = list(history[size - n :])
        for i in range(size - n - 1, -1, -1):
            if history[i + n - 1] != tail[-1] or list(history[i : i + n]) != tail:
                continue
            out: list[int] = []
            for j in range(k):
                at = i + n + j
                out.append(history[at] if at < size else out[at - size])
            return out
    return None


class NgramGenerator(VerifyingGenerator):
    """A :class:`~.speculative.VerifyingGenerator` of ``model`` whose ``k`` proposals per slot
    come from the slot's own text (:func:`propose_ngram` with ``lookup_max`` / ``lookup_min``).
    The other arguments are :class:`~.slot_generator.SlotGenerator`'s."""

    n_noise = 2  # uniforms and the final token's noise: the proposal is not drawn

    def __init__(
        self,
        model,
        slots: int,
        max_len: int,
        *,
        k: int = DEFAULT_K,
        lookup_max: int = DEFAULT_LOOKUP_MAX,
        lookup_min: int = DEFAULT_LOOKUP_MIN,
        **kw,
    ):
        check_lookup(lookup_max, lookup_min)
        super().__init__(model, slots, max_len, k=k, **kw)
        self.lookup_max, self.lookup_min = lookup_max, lookup_min
        self._history: dict[int, list[int]] = {}  # slot -> its prompt and output so far

    def history(self, slot: int) -> list[int]:
        """The tokens ``slot`` holds so far: its prompt (prefilled or copied by a prefix
        cache) and its output; the lookup's text."""
        return list(self._history[slot])

    def acquire(self) -> int | None:
        slot = super().acquire()
        if slot is not None:
            self._history[slot] = []
        return slot

    def release(self, slot: int) -> None:
        super().release(slot)
        self._history.pop(slot, None)

    def mark_filled(self, slot: int, tokens: Sequence[int]) -> None:
        super().mark_filled(slot, tokens)
        self._history[slot] = list(tokens)

    def prefill(
        self, slot: int, tokens: Sequence[int], start: int, sampling=None, **kw
    ) -> int | None:
        """:meth:`SlotGenerator.prefill`; the chunk (and the first new token) join the slot's
        history."""
        out = SlotGenerator.prefill(self, slot, tokens, start, sampling, **kw)
        history = self._history[slot]
        del history[start:]
        history.extend(tokens)
        if out is not None:
            history.append(out)
        return out

    def decode(self) -> dict[int, list[int]]:
        out = super().decode()
        for slot, tokens in out.items():
            self._history[slot].extend(tokens)
        return out

    # -- the proposer ------------------------------------------------------------------------
    def _proposer_inputs(self, bucket: int) -> list[torch.Tensor]:
        """The ``[slots, K]`` proposals of the active slots (other rows: 0)."""
        rows = torch.zeros(self.slots, self.k, dtype=torch.long)
        for s in self.active:
            history = self._history[s]
            found = propose_ngram(
                history, self.k, lookup_max=self.lookup_max, lookup_min=self.lookup_min
            )
            rows[s] = torch.tensor(found or [history[-1]] * self.k)
        return [rows.to(self.device)]

    def _propose(self, rows, last, inputs, noise):
        proposed = inputs[0][: last.shape[0]]
        q = None
        if noise:
            q = torch.nn.functional.one_hot(proposed, self.vocab).float()
        return proposed, q, []

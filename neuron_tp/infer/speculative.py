"""Speculative decoding with a draft model on the slots of a
:class:`~.slot_generator.SlotGenerator`.

Each step, for every active slot at once, ONE graph (per decode bucket, greedy or sampled):

1. the draft proposes ``K`` tokens per slot: ``K + 1`` single-token draft steps (the last only
   writes the draft's key and value of the K-th proposal, so the draft's cache holds every
   position the target may accept), in the draft's own cache rows (the same slot indices);
2. the target verifies all slots in one forward of ``K + 1`` positions per slot (the slot's
   last token and the K proposals), and each row accepts its own number ``n`` of proposals,
   ``0..K``, plus one token of the target's: greedy rows accept while the proposal is the
   target's argmax, sampled rows follow the rejection rule of :func:`accept_sampled`, so their
   tokens are distributed as the target's alone.

Positions are data: a row advances by ``n + 1`` (its position and last token are graph
outputs), the rejected proposals stay in both caches at positions past the row's new one,
where the attention mask (``kv <= position``) hides them until they are overwritten. The
shapes depend on ``K`` and the bucket only: the graph set is the target's prefill buckets
(greedy, sampled), the draft's (cache only) and one speculative graph per decode bucket
(greedy, sampled), all captured by :meth:`SpeculativeGenerator.warmup`.

The step itself is :class:`VerifyingGenerator`'s: only the proposer differs. Here it is the
draft model; :class:`~.ngram.NgramGenerator` proposes from the slot's own text (prompt lookup)
with the same verification and acceptance rule. With a prefix cache, the draft's cache is a
part of the pool (:meth:`SpeculativeGenerator.cache_parts`): a hit skips the draft's prefill too.

At tp > 1 the draft is sharded like the target over the same ranks, in the same graph: the
logits of both are identical on every rank (gathered), so every rank accepts the same tokens
and the engine's leases carry nothing new.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..errors import UserError
from .model_step import no_aux_outputs
from .sampling import host_noise, row_probs
from .slot_generator import SlotGenerator, SlotState

DEFAULT_K = 4


class Verdict(NamedTuple):
    """What each row keeps of one verification: ``accepted`` [B] proposals (``0..K``) and
    ``tokens`` [B, K+1]: the accepted proposals, then the target's token at index
    ``accepted`` (later entries are meaningless)."""

    accepted: torch.Tensor
    tokens: torch.Tensor


def _keep(proposed: torch.Tensor, accepted: torch.Tensor, final: torch.Tensor) -> Verdict:
    k = proposed.shape[1]
    idx = torch.arange(k + 1, device=proposed.device)[None]
    padded = torch.cat([proposed, proposed[:, -1:]], 1)
    return Verdict(accepted, torch.where(idx < accepted[:, None], padded, final[:, None]))


def _leading(ok: torch.Tensor) -> torch.Tensor:
    """How many leading entries of each row of ``ok`` [B, K] are True."""
    return ok.long().cumprod(-1).sum(-1)


def accept_greedy(proposed: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy verification: ``proposed`` [B, K] is accepted while each token is the target's
    argmax at its position (``target_logits`` [B, K+1, V]); then the target's argmax."""
    best = target_logits.argmax(-1)
    n = _leading(proposed == best[:, :-1])
    return _keep(proposed, n, best.gather(1, n[:, None])[:, 0])


def accept_sampled(
    proposed: torch.Tensor,
    p_target: torch.Tensor,
    p_draft: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> Verdict:
    """The rejection rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023):
    proposal ``x`` at position ``i`` (drawn from ``p_draft[:, i]``) is accepted when
    ``uniform[:, i] < p_target(x) / p_draft(x)``; at the first rejection the row's token is
    drawn from ``max(0, p_target - p_draft)`` (normalised), after K acceptances from
    ``p_target[:, K]``. The tokens are then distributed as the target's alone.

    ``proposed`` [B, K]; ``p_target`` [B, K+1, V]; ``p_draft`` [B, K, V]; ``uniform`` [B, K]
    in ``[0, 1)``; ``noise`` [B, V] Exp(1): the draw is ``argmax(weights / noise)``."""
    b, k = proposed.shape
    pt = p_target[:, :k].gather(-1, proposed[..., None])[..., 0]
    pd = p_draft.gather(-1, proposed[..., None])[..., 0]
    n = _leading(uniform * pd < pt)
    # a zero draft row after the K-th: with every proposal accepted the weights are p_target
    q = torch.cat([p_draft, torch.zeros_like(p_draft[:, :1])], 1)
    at = n[:, None, None].expand(b, 1, p_target.shape[-1])
    weights = (p_target.gather(1, at) - q.gather(1, at))[:, 0].clamp(min=0)
    return _keep(proposed, n, (weights / noise).argmax(-1))


@dataclass
class SpeculationStats:
    """Counters of a :class:`SpeculativeGenerator` (host values, updated every step)."""

    k: int
    steps: int = 0  # speculative graphs run (target forwards)
    row_steps: int = 0  # active rows verified, summed over steps
    proposed: int = 0  # draft tokens proposed (K per row step)
    accepted: int = 0  # of them accepted by the target
    tokens: int = 0  # tokens produced (accepted + one per row step)

    def add_row(self, accepted: int) -> None:
        """One row verified, ``accepted`` of its K proposals kept."""
        self.row_steps += 1
        self.proposed += self.k
        self.accepted += accepted
        self.tokens += accepted + 1

    @property
    def acceptance(self) -> float:
        """Accepted / proposed draft tokens (0 before any step)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a slot gets per target forward (1..K+1; plain decoding: 1)."""
        return self.tokens / self.row_steps if self.row_steps else 0.0


def check_speculation(k: int, max_len: int) -> None:
    """UserError unless ``k`` proposals fit: ``k >= 1`` and a slot of ``max_len`` positions
    holds a prompt token plus the ``k + 1`` positions one step verifies."""
    if k < 1:
        raise UserError(f"--speculation-length must be >= 1 (draft tokens per step), got {k}")
    if k + 2 > max_len:
        raise UserError(
            f"--speculation-length {k} leaves no room in a slot of {max_len} positions (one "
            f"step verifies k + 1 = {k + 1} positions after at least one prompt token): use "
            f"k <= {max_len - 2}, or longer slots (--buckets / --max-new-tokens)"
        )


class VerifyingGenerator(SlotGenerator):
    """A :class:`SlotGenerator` of ``model`` whose :meth:`decode` verifies ``k`` proposed
    tokens per active slot in one graph and returns ``{slot: [1..k+1 tokens]}``; where the
    proposals come from is the subclass's (:class:`SpeculativeGenerator`: a draft model in the
    graph; :class:`~.ngram.NgramGenerator`: the slot's own text, on the host). The other
    arguments are :class:`SlotGenerator`'s; ``stats``: :class:`SpeculationStats`."""

    n_noise = 3  # host draws per sampled step: the draft's noise, uniforms, final noise
    logprobs_supported = False  # the verification returns no log-probabilities
    grammar_supported = False  # nor applies a grammar to the proposed tokens

    def __init__(self, model, slots: int, max_len: int, *, k: int = DEFAULT_K, **kw):
        check_speculation(k, max_len)
        super().__init__(model, slots, max_len, **kw)
        self.k, self.stats = k, SpeculationStats(k)

    def check(self, prompt_len: int, max_new_tokens: int, sampling, **kw) -> None:
        """:meth:`SlotGenerator.check`; ValueError for what the verification does not apply:
        ``top_p``, ``min_p``, the penalties and ``logit_bias``."""
        super().check(prompt_len, max_new_tokens, sampling, **kw)
        if sampling.adjusts or sampling.filters:
            raise ValueError(
                "top_p, min_p, presence/frequency/repetition penalties and logit_bias are not "
                "supported with speculative decoding (--draft-model / --speculation-method)"
            )

    def decode(self) -> dict[int, list[int]]:
        """One speculative step of every active slot: ``{slot: its new tokens}`` (1..k+1)."""
        if not self.active:
            return {}
        bucket = self._decode_bucket()
        noise = self._noise(bucket) if any(s in self._gens for s in self.active) else None
        packed = self._run_speculate(bucket, self._active(), noise).cpu().tolist()
        out, st = {}, self.stats
        for s in sorted(self.active):
            n = packed[s][0]
            out[s] = packed[s][1 : n + 2]
            self._host_pos[s] += n + 1
            st.add_row(n)
        st.steps += 1
        return out

    def warmup(self) -> None:
        """Capture every graph: the target's prefill (greedy, sampled), the proposer's and
        the speculative step of each decode bucket (greedy, sampled)."""
        self.warmup_prefill()
        self._warmup_proposer()
        none = torch.zeros(self.slots, dtype=torch.bool).to(self.device)
        for bucket in self.decode_buckets:
            for sampled in (False, True):
                noise = self._noise(bucket) if sampled else None
                self._run_speculate(bucket, none, noise)
        self._active_dirty = True

    # -- the proposer's part (subclasses) ---------------------------------------------------------
    def _warmup_proposer(self) -> None:
        """Capture the proposer's own graphs."""

    def _proposer_inputs(self, bucket: int) -> list[torch.Tensor]:
        """The speculative graph's inputs after the noise (the draft's cache, proposals...)."""
        raise NotImplementedError

    def _keep_proposer_outputs(self, outs: list[torch.Tensor]) -> None:
        """Keep what the graph returned for the proposer (as many as its inputs)."""

    def _propose(self, rows: _Rows, last, inputs, noise):
        """In the graph: ``(proposed [B, K], the proposal distributions [B, K, V] when sampled
        (else None), the proposer's outputs)``."""
        raise NotImplementedError

    # -- device side ------------------------------------------------------------------------
    def _noise(self, bucket: int) -> list[torch.Tensor]:
        """The host draws of a sampled step, per sampled row from its own generator (in a fixed
        order: K draft noises when :attr:`n_noise` is 3, K uniforms, the final token's noise):
        ``[bucket, K, V]``, ``[bucket, K]``, ``[bucket, V]``, on the device."""
        k, v, draft_noise = self.k, self.vocab, self.n_noise == 3
        draft, uniform, final = (
            torch.ones(bucket, k, v),
            torch.zeros(bucket, k),
            torch.ones(bucket, v),
        )
        for s, gen in self._gens.items():
            if s < bucket:
                if draft_noise:
                    draft[s] = host_noise(gen, k, v)
                uniform[s] = torch.rand(k, generator=gen)
                final[s] = host_noise(gen, 1, v)[0]
        drawn = (draft, uniform, final) if draft_noise else (uniform, final)
        return [t.to(self.device) for t in drawn]

    def _run_speculate(self, bucket: int, active, noise: list[torch.Tensor] | None):
        """Run the speculative graph of ``bucket``; returns ``[slots, k + 2]`` (accepted count,
        then the row's tokens) and keeps the new state, the cache and the proposer's outputs."""
        sampled = noise is not None
        inputs = self._proposer_inputs(bucket)
        args = [active, *self._state, *(noise or []), *inputs]
        out = self._run_model(
            ("speculate", bucket, sampled),
            lambda: self._speculate_fn(bucket, sampled, len(inputs)),
            args,
        )
        self._state = self._state._replace(tokens=out[1], pos=out[2])
        n_out = len(out) - 3 - len(self._kv)
        self._keep_proposer_outputs(out[3 : 3 + n_out])
        self._kv = out[3 + n_out :]
        return out[0]

    def _speculate_fn(self, bucket: int, sampled: bool, n_inputs: int):
        n_state, k = len(SlotState._fields), self.k
        n_noise = self.n_noise if sampled else 0

        def step(active, *rest):
            state = SlotState(*rest[:n_state])
            noise = rest[n_state : n_state + n_noise]
            inputs = rest[n_state + n_noise : n_state + n_noise + n_inputs]
            kv = rest[n_state + n_noise + n_inputs :]
            b = slice(0, bucket)
            rows = _Rows(
                active[b], state.pos[b], state.temperature[b], state.top_k[b], state.sample[b]
            )
            last = state.tokens[b]
            proposed, q, proposer_out = self._propose(rows, last, inputs, noise)
            with self.adapters(state.adapter[b]):  # the target's LoRA adapters, not the draft's
                logits, target_out = self._verify(rows, last, proposed, kv)
            verdict = accept_greedy(proposed, logits)
            if sampled:
                p = row_probs(
                    logits.flatten(0, 1),
                    rows.temperature.repeat_interleave(k + 1),
                    rows.top_k.repeat_interleave(k + 1),
                ).view(logits.shape)
                drawn = accept_sampled(proposed, p, q, noise[-2], noise[-1])
                verdict = Verdict(
                    torch.where(rows.sample, drawn.accepted, verdict.accepted),
                    torch.where(rows.sample[:, None], drawn.tokens, verdict.tokens),
                )
            room = (self.max_len - 1 - rows.pos).clamp(min=0)  # later tokens are past max_len
            n = torch.where(rows.active, torch.minimum(verdict.accepted, room), 0)
            new_last = torch.where(rows.active, verdict.tokens.gather(1, n[:, None])[:, 0], last)
            packed = torch.cat([n[:, None], verdict.tokens], 1)
            rest_rows = torch.zeros(self.slots - bucket, k + 2, dtype=packed.dtype)
            return [
                torch.cat([packed, rest_rows.to(packed.device)]),
                torch.cat([new_last, state.tokens[bucket:]]),
                torch.cat([rows.pos + torch.where(rows.active, n + 1, 0), state.pos[bucket:]]),
                *proposer_out,
                *target_out,
            ]

        return self.with_split_attention(step)

    def _verify(self, rows: _Rows, last, proposed, kv):
        """The target's logits [B, K+1, V] at the row's last token and its K proposals."""
        ids = torch.cat([last[:, None], proposed], 1)
        logits, kv = self._forward(self, rows, ids, list(kv), 0)
        return logits, kv

    def _forward(self, gen: SlotGenerator, rows: _Rows, ids, kv: list, offset: int):
        """``gen``'s model (the target's, or the draft's) on ``ids`` [B, Q] at positions
        ``pos + offset + 0..Q-1`` of each row (inactive rows and positions past the slot:
        scratch), the cache written there (at its local rows, split by sequence); its logits
        [B, Q, V] and the cache tensors."""
        from .slot_cache import SlotCache

        scratch, (b, q) = self.max_len, ids.shape
        at = rows.pos[:, None] + offset + torch.arange(q, device=ids.device)[None]
        valid = rows.active[:, None] & (at < scratch)
        qpos = torch.where(valid, at, scratch)
        cache = SlotCache(
            kv, torch.arange(b, device=ids.device), qpos, slice(0, b), split=gen.split
        )
        out = gen.model(
            input_ids=ids,
            attention_mask=gen.cache_mask(qpos),
            position_ids=torch.where(valid, at, 0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0,
            **no_aux_outputs(gen.model.config),
        )
        return out.logits, cache.tensors()


class SpeculativeGenerator(VerifyingGenerator):
    """A :class:`VerifyingGenerator` whose proposals come from ``draft`` (a smaller causal LM
    of the same vocabulary, on the same device and tp ranks, its cache in slot rows of its
    own), run in the speculative graph."""

    def __init__(self, model, draft, slots: int, max_len: int, *, k: int = DEFAULT_K, **kw):
        vocab = model.config.get_text_config(decoder=True).vocab_size
        draft_vocab = draft.config.get_text_config(decoder=True).vocab_size
        if vocab != draft_vocab:
            raise UserError(
                f"the draft model's vocabulary ({draft_vocab} tokens) differs from the target "
                f"model's ({vocab}): speculation needs the same tokenizer and vocabulary"
            )
        super().__init__(model, slots, max_len, k=k, **kw)
        kw = {n: v for n, v in kw.items() if n != "decode_buckets"}
        # the target split by sequence: the draft too where its kv heads are replicated
        kw["kv_split"] = "auto" if self.split is not None else "heads"
        self.draft = SlotGenerator(draft, slots, max_len, **kw)

    def with_split_attention(self, step):
        """The speculative step runs both models: each one's split attention switched on."""
        return super().with_split_attention(self.draft.with_split_attention(step))

    @property
    def traces(self) -> int:
        """Captures of the target's graphs and the draft's (replay mode)."""
        return self._graphs.traces + self.draft.traces

    def cache_parts(self) -> list[SlotGenerator]:
        """The target's cache and the draft's (a prefix cache pools both)."""
        return [self, self.draft]

    def acquire(self) -> int | None:
        slot = super().acquire()
        if slot is not None and self.draft.acquire() != slot:
            raise RuntimeError(f"the draft's slots are out of step with the target's ({slot})")
        return slot

    def release(self, slot: int) -> None:
        super().release(slot)
        self.draft.release(slot)

    def mark_filled(self, slot: int, tokens: Sequence[int]) -> None:
        """Both caches of ``slot`` hold ``tokens`` already (a prefix cache copied them)."""
        super().mark_filled(slot, tokens)
        self.draft.mark_filled(slot, tokens)

    def prefill(
        self, slot: int, tokens: Sequence[int], start: int, sampling=None, **kw
    ) -> int | None:
        """:meth:`SlotGenerator.prefill` of the target, then the same chunk into the draft's
        cache (no token chosen there)."""
        out = super().prefill(slot, tokens, start, sampling, **kw)
        self.draft.prefill(slot, tokens, start)
        return out

    # -- the draft ------------------------------------------------------------------------------
    def _warmup_proposer(self) -> None:
        self.draft.warmup_prefill((False,))

    def _proposer_inputs(self, bucket: int) -> list[torch.Tensor]:
        return list(self.draft.kv)

    def _keep_proposer_outputs(self, outs: list[torch.Tensor]) -> None:
        self.draft.kv = outs

    def _propose(self, rows: _Rows, last, draft_kv, noise):
        """K draft tokens per row (sampled rows draw with ``noise[0]``) and, when sampled,
        the draft's distributions [B, K, V]; then one more step writes the K-th token's keys."""
        k = self.k
        kv, token, proposed, probs = list(draft_kv), last, [], []
        for i in range(k + 1):
            logits, kv = self._forward(self.draft, rows, token[:, None], kv, i)
            if i == k:
                break
            token = logits[:, -1].argmax(-1)
            if noise:
                q = row_probs(logits[:, -1], rows.temperature, rows.top_k)
                token = torch.where(rows.sample, (q / noise[0][:, i]).argmax(-1), token)
                probs.append(q)
            proposed.append(token)
        return torch.stack(proposed, 1), torch.stack(probs, 1) if probs else None, kv


class _Rows(NamedTuple):
    """The per-row inputs of a speculative step (the decode bucket's rows)."""

    active: torch.Tensor
    pos: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    sample: torch.Tensor

"""The step functions a :class:`~.slot_generator.SlotGenerator` captures as graphs: a prompt
chunk's prefill and one decode step of its rows. Each runs the model with the rows' LoRA
adapters selected (:meth:`~.slot_generator.SlotGenerator.adapters`) and returns the new
:class:`~.slot_records.SlotState` and KV cache."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .model_step import cache_kwargs, no_aux_outputs
from .sampling import choose_adjusted, token_logprobs, unpack_allowed
from .slot_records import ChunkMeta, DecodeVariant, SlotState


class SlotGenerator(Protocol):
    """What the steps read of their :class:`~.slot_generator.SlotGenerator`."""

    model: Any
    max_len: int
    slots: int
    split: Any

    def cache_mask(self, qpos: torch.Tensor) -> torch.Tensor: ...
    def with_split_attention(self, step): ...
    def adapters(self, index: torch.Tensor): ...


def bank_bound(lora, step):
    """``step`` taking the LoRA bank ``lora``'s tensors as its first arguments (bound to the
    bank's layers while it runs)."""
    n = len(lora.tensors)

    def run(*args):
        with lora.bound(args[:n]):
            return step(*args[n:])

    return run


def prefill_step(gen: SlotGenerator, bucket: int, sampled: bool, prompt_lp: bool = False):
    """The step of one prefill chunk of ``gen`` (bucket ``bucket``; ``sampled``: its rows may
    sample; ``prompt_lp``: it also returns every position's log-probabilities)."""
    from .slot_cache import SlotCache

    model, scratch, n_state = gen.model, gen.max_len, len(SlotState._fields)

    def step(ids, meta, floats, seen, bias, words, *rest):  # noqa: PLR0917
        noise, rest = (rest[0], rest[1:]) if sampled else (None, rest)
        temp, params = floats[:, 0], floats[:, 1:]
        state, kv = SlotState(*rest[:n_state]), rest[n_state:]
        m = ChunkMeta.read(meta)
        final = m.final.bool()
        idx = torch.arange(bucket, device=ids.device)
        valid = idx < m.length
        qpos = torch.where(valid, m.start + idx, torch.full_like(idx, scratch))[None]
        cache = SlotCache(list(kv), m.slot, qpos, m.slot, split=gen.split)
        with gen.adapters(m.adapter):
            out = model(
                input_ids=ids,
                attention_mask=gen.cache_mask(qpos),
                position_ids=torch.where(valid, m.start + idx, torch.zeros_like(idx))[None],
                **cache_kwargs(model, cache),
                use_cache=True,
                logits_to_keep=0 if prompt_lp else (m.length - 1).clamp(min=0),
                **no_aux_outputs(model.config),
            )
        last = (m.length - 1).clamp(min=0)
        logits = out.logits[0] if prompt_lp else None
        row = out.logits[0].index_select(0, last) if prompt_lp else out.logits[:, -1]
        zeros = torch.zeros_like(bias)
        rows = (temp, m.top_k, params, zeros, seen, bias + unpack_allowed(words, bias.shape[-1]))
        tok = choose_adjusted(row, rows, m.sampled.bool(), noise)
        lp = token_logprobs(row, tok)

        def put(row, value):  # row[slot] = value on the last chunk
            new = torch.where(final, value.to(row.dtype), row.index_select(0, m.slot))
            return row.index_put((m.slot,), new)

        counted = zeros.scatter(-1, tok[:, None], 1.0)
        new = SlotState(
            tokens=put(state.tokens, tok),
            pos=put(state.pos, m.start + m.length),
            temperature=put(state.temperature, temp),
            top_k=put(state.top_k, m.top_k),
            sample=put(state.sample, m.sampled.bool()),
            params=put(state.params, params),
            counts=put(state.counts, counted),
            seen=put(state.seen, seen),
            bias=put(state.bias, bias),
            adapter=put(state.adapter, m.adapter),
        )
        prompt = []
        if prompt_lp:
            targets = torch.where(idx < m.length - 1, ids[0].roll(-1), m.next)
            prompt = [token_logprobs(logits, targets)]
        return [tok, lp, *prompt, *new, *cache.tensors()]

    return gen.with_split_attention(step)


def decode_step(gen: SlotGenerator, bucket: int, variant: DecodeVariant):
    """The step that decodes one token for the rows ``[0, bucket)`` of ``gen``, computing
    what ``variant`` says (its arguments: the active flags, the state, then the noise when
    sampled and the packed grammar rows when it adjusts, then the cache)."""
    from .slot_cache import SlotCache

    model, scratch, n_state = gen.model, gen.max_len, len(SlotState._fields)
    v = variant

    def step(active, *rest):
        state, rest = SlotState(*rest[:n_state]), rest[n_state:]
        noise, rest = (rest[0], rest[1:]) if v.sampled else (None, rest)
        words, kv = (rest[0], rest[1:]) if v.adjust else (None, rest)
        b = slice(0, bucket)
        a, last, pos = active[b], state.tokens[b], state.pos[b]
        qpos = torch.where(a, pos, torch.full_like(pos, scratch))[:, None]
        rows = torch.arange(bucket, device=last.device)
        cache = SlotCache(list(kv), rows, qpos, b, split=gen.split)
        with gen.adapters(state.adapter[b]):
            out = model(
                input_ids=last[:, None],
                attention_mask=gen.cache_mask(qpos),
                position_ids=torch.where(a, pos, torch.zeros_like(pos))[:, None],
                **cache_kwargs(model, cache),
                use_cache=True,
                logits_to_keep=1,
                **no_aux_outputs(model.config),
            )
        logits = out.logits[:, -1]
        rest_rows = gen.slots - bucket
        whole = lambda t: torch.cat([t, t.new_zeros((rest_rows, *t.shape[1:]))])  # noqa: E731
        if v.adjust:
            counts, bias = state.counts[b], state.bias[b]
            rows = (state.temperature[b], state.top_k[b], state.params[b], counts)
            rows += (state.seen[b], bias + unpack_allowed(words[b], bias.shape[-1]))
            tok = choose_adjusted(logits, rows, state.sample[b], noise, v.nucleus)
        else:
            tok = logits.argmax(-1)
        tok = torch.where(a, tok, last)
        new = [torch.cat([tok, state.tokens[bucket:]])]
        new.append(torch.cat([pos + a.long(), state.pos[bucket:]]))
        if v.adjust:
            counts = counts.scatter_add(-1, tok[:, None], a.float()[:, None])
            new.append(torch.cat([counts, state.counts[bucket:]]))
        if v.logprobs:
            new.append(whole(token_logprobs(logits, tok)))
        return [*new, *cache.tensors()]

    return gen.with_split_attention(step)

"""Random continuous-batching schedules for SlotGenerator tests, and their reference: each
request generated ALONE by transformers (greedy ``generate``, or ``hf_sample`` for a seed)."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_sampling import hf_sample, peaked
from neuron_tp.infer.sampling import Sampling


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    new: int
    sampling: Sampling


def make_requests(seed: int, n: int, max_prompt: int, max_new: int, vocab: int = 256) -> list:
    """``n`` requests: prompt lengths 1..max_prompt, 1..max_new new tokens, about half of them
    sampled (own seed, temperature, top_k), the rest greedy."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(1, max_prompt))]
        if rng.random() < 0.5:
            s = Sampling(
                True, rng.choice([0.7, 1.0, 1.3]), rng.choice([0, 5, 20]), rng.randrange(1000)
            )
        else:
            s = Sampling()
        reqs.append(Req(prompt, rng.randint(1, max_new), s))
    return reqs


def reference(full, req: Req) -> list[int]:
    """The tokens transformers generates for ``req`` alone on the unsharded model."""
    with torch.no_grad():
        if req.sampling.do_sample:
            s = req.sampling
            return hf_sample(full, [req.prompt], req.new, s.temperature, s.top_k, s.seed)[0]
        ids = torch.tensor([req.prompt])
        out = full.generate(ids, max_new_tokens=req.new, do_sample=False, pad_token_id=0)
        return out[0, len(req.prompt) :].tolist()


def eos_ids(full) -> list[int]:
    """The EOS ids transformers' ``generate`` stops at for ``full`` (its generation config)."""
    eos = full.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def run_schedule(
    gen, reqs: list, seed: int, eos: Sequence[int] = (), join: float = 0.6
) -> list[list[int]]:
    """Serve ``reqs`` on ``gen`` with a random schedule: each iteration maybe admits the next
    request into a free slot, prefills ONE chunk (random length <= gen.chunk) of a random
    prefilling slot, then decodes every active slot; a request is released as soon as it has
    its tokens or an ``eos`` id. Checks that decode reports exactly the decoding slots."""
    rng = random.Random(seed)
    waiting = deque(range(len(reqs)))
    prefilling: dict[int, tuple[int, int]] = {}  # slot -> (request, next prompt offset)
    decoding: dict[int, int] = {}  # slot -> request
    out: list[list[int]] = [[] for _ in reqs]

    def take(slot: int, i: int, token: int) -> None:
        out[i].append(token)
        if len(out[i]) == reqs[i].new or token in eos:
            gen.release(slot)
            decoding.pop(slot, None)
        else:
            decoding[slot] = i

    with torch.no_grad():
        while waiting or prefilling or decoding:
            if waiting and (rng.random() < join or not (prefilling or decoding)):
                slot = gen.acquire()
                if slot is not None:
                    prefilling[slot] = (waiting.popleft(), 0)
            if prefilling:
                slot = rng.choice(sorted(prefilling))
                i, off = prefilling[slot]
                prompt = reqs[i].prompt
                end = off + rng.randint(1, gen.chunk)
                last = end >= len(prompt)
                t = gen.prefill(slot, prompt[off:end], off, reqs[i].sampling if last else None)
                if last:
                    del prefilling[slot]
                    take(slot, i, t)
                else:
                    assert t is None
                    prefilling[slot] = (i, end)
            got = gen.decode()
            assert set(got) == set(decoding), (sorted(got), sorted(decoding))
            for slot, new in got.items():  # speculative decoding: several tokens
                for t in new:
                    if slot not in decoding:
                        break
                    take(slot, decoding[slot], t)
    return out


def kv1_llama(max_positions: int = 4096):
    """A tiny Llama with ONE kv head (4 query heads, hidden 64, 2 layers): replicated on every
    rank at tp 2 (the sequence-split KV cache's case)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        vocab_size=257,
        attn_implementation="sdpa",
    )
    torch.manual_seed(4)
    return peaked(LlamaForCausalLM(cfg)).eval()


def long_request(n: int, new: int = 6) -> Req:
    """A greedy request with a prompt of ``n`` random tokens."""
    g = torch.Generator().manual_seed(n)
    return Req(torch.randint(1, 256, (n,), generator=g).tolist(), new, Sampling())


def run_long(gen, req: Req, chunk: int) -> list[int]:
    """Prefill ``req`` chunk by chunk into a slot of ``gen``, decode its tokens, release it."""
    slot, n = gen.acquire(), len(req.prompt)
    with torch.no_grad():
        for start in range(0, n, chunk):
            last = start + chunk >= n
            part = req.prompt[start : start + chunk]
            tok = gen.prefill(slot, part, start, req.sampling if last else None)
        out = [tok]
        while len(out) < req.new:
            out += gen.decode()[slot]
    gen.release(slot)
    return out

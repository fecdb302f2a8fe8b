"""Sharded generation with static shapes: prompts left-padded to a few length buckets, a
static KV cache whose length does not depend on the number of new tokens (rounded up), the
attention mask built in the graph (transformers' own mask code reads the padding mask on the
host), one prefill graph per bucket and one decode graph, greedy or sampling (Gumbel-max,
identical on every tp rank), no host read until the end."""
from __future__ import annotations

import torch

from . import compile as C

CACHE_ROUND = 128  # the cache holds max(buckets) + new tokens rounded up to this


def pick_bucket(length: int, buckets: list[int]) -> int:
    """The smallest bucket that holds ``length`` tokens (ValueError when none does)."""
    for b in sorted(buckets):
        if length <= b:
            return b
    raise ValueError(f"prompt of {length} tokens is longer than the largest bucket "
                     f"{max(buckets)}; add a larger --buckets value")


def cache_length(buckets: list[int], max_new_tokens: int) -> int:
    return max(buckets) + -(-max_new_tokens // CACHE_ROUND) * CACHE_ROUND


def _choose(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    u = torch.rand(logits.shape, device=logits.device).clamp_(1e-10, 1.0)
    return (logits - torch.log(-torch.log(u))).argmax(-1)


def attention_mask_4d(pad_mask: torch.Tensor, cache_pos: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, queries, cache]`` boolean mask built in the graph from device tensors:
    causal over cache positions, padding excluded, every query sees itself (padding rows
    would otherwise be empty and produce NaN keys/values in later layers)."""
    kv = torch.arange(pad_mask.shape[-1], device=pad_mask.device)
    q = cache_pos[:, None]
    allowed = (kv[None, :] <= q) & pad_mask.bool()[:, None, :]  # [batch, q, cache]
    return (allowed | (kv[None, :] == q))[:, None]


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, buckets: list[int],
             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
             seed: int = 0, pad_id: int = 0) -> list[list[int]]:
    """New token ids for each prompt (exactly ``max_new_tokens`` each).

    ``model``: a transformers causal LM (sharded by ``neuron_tp.hf`` or not) on its device;
    every tp rank calls this with the same prompts and seed and gets the same tokens."""
    from transformers import StaticCache
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    dev = next(model.parameters()).device
    bucket = pick_bucket(max(len(p) for p in prompts), buckets)
    total = cache_length(buckets, max_new_tokens)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and total > limit:
        raise ValueError(f"cache of {total} positions (largest bucket + new tokens rounded up "
                         f"to {CACHE_ROUND}) exceeds max_position_embeddings={limit}")
    batch = len(prompts)
    ids = torch.full((batch, bucket), pad_id, dtype=torch.long)
    mask = torch.ones((batch, total), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, bucket - len(p):] = torch.tensor(p)
        mask[i, :bucket - len(p)] = 0
    pos = (mask[:, :bucket].cumsum(-1) - 1).clamp(min=0)
    torch.manual_seed(seed)
    if dev.type == "xla":
        from .. import _xla
        _xla.xm().set_rng_state(seed)
    ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
    cache = StaticCache(config=model.config, max_cache_len=total)
    cache_pos = torch.arange(bucket, device=dev)
    out = model(input_ids=ids, attention_mask=attention_mask_4d(mask, cache_pos),
                position_ids=pos, cache_position=cache_pos,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = _choose(out.logits[:, -1], do_sample, temperature, top_k)
    # Tokens go into a device buffer as wide as the cache (not as the token count), at a
    # device-side index: the decode graph is the same at every step and for any length.
    buf = torch.zeros((batch, total), dtype=torch.long, device=dev)
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    buf.index_copy_(1, slot, tok[:, None])
    # Decode inputs uploaded from the host (not sliced from bucket-shaped tensors), so the
    # decode graph is one and the same for every bucket and every step.
    pos = torch.tensor([[len(p)] for p in prompts]).to(dev)
    cache_pos = torch.tensor([bucket]).to(dev)
    C.step_boundary(dev)
    for _ in range(max_new_tokens - 1):
        out = model(input_ids=tok[:, None], attention_mask=attention_mask_4d(mask, cache_pos),
                    position_ids=pos,
                    cache_position=cache_pos, past_key_values=cache, use_cache=True)
        tok = _choose(out.logits[:, -1], do_sample, temperature, top_k)
        slot = slot + 1
        buf.index_copy_(1, slot, tok[:, None])
        pos, cache_pos = pos + 1, cache_pos + 1
        C.step_boundary(dev)
    return buf.cpu()[:, :max_new_tokens].tolist()


def load_for_generation(args, mesh):
    """The model named by ``args`` sharded over ``mesh`` (a local dir is read slice by slice)."""
    from .. import hf
    from .data import load_tokenizer, vocab_size
    from .presets import build_model, is_preset
    tok = load_tokenizer(args.tokenizer)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    if is_preset(args.model):
        model = hf.parallelize(build_model(args.model, vocab_size(tok), args.seed, dtype), mesh)
    else:
        model = hf.from_pretrained(args.model, mesh, torch_dtype=dtype)
    return model.eval(), tok


def run_cli(args) -> list[str]:
    """``neuron-tp generate``: print each prompt's continuation (rank 0)."""
    from ..mesh import init_mesh
    from .loop import _device
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as fh:
            prompts += [ln.rstrip("\n") for ln in fh if ln.strip()]
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    device = _device(args.device)
    mesh = init_mesh(tp=args.tp)
    model, tok = load_for_generation(args, mesh)
    model.to(device)
    encoded = [tok.encode(p) for p in prompts]
    pad = getattr(tok, "pad_token_id", None) or 0
    out = generate(model, encoded, args.max_new_tokens, args.buckets, args.do_sample,
                   args.temperature, args.top_k, args.seed, pad)
    texts = [tok.decode(o) for o in out]
    if mesh.rank == 0:
        for p, t in zip(prompts, texts):
            print(f"{p!r} -> {t!r}")
        print(f"graph compiles: {C.graph_counters()['compiles']}")
    return texts

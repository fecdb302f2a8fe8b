"""Sharded generation with static shapes: prompts left-padded to a few length buckets, a
static KV cache whose length does not depend on the number of new tokens (rounded up), the
attention mask built in the graph (transformers' own mask code reads the padding mask on the
host), one prefill graph per bucket and one decode graph, greedy or sampling (Gumbel-max,
identical on every tp rank), no host read until the end."""

from __future__ import annotations

import argparse
import os

import torch

from ..sharding import move_to
from .config import GenerateConfig
from .graphs import graph_counters, step_boundary

CACHE_ROUND = 128  # the cache holds max(buckets) + new tokens rounded up to this


def pick_bucket(length: int, buckets: list[int]) -> int:
    """The smallest bucket that holds ``length`` tokens (ValueError when none does)."""
    for b in sorted(buckets):
        if length <= b:
            return b
    raise ValueError(
        f"prompt of {length} tokens is longer than the largest bucket "
        f"{max(buckets)}; add a larger --buckets value"
    )


def cache_length(buckets: list[int], max_new_tokens: int) -> int:
    return max(buckets) + -(-max_new_tokens // CACHE_ROUND) * CACHE_ROUND


def _choose(
    logits: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_k: int,
    gen: torch.Generator | None = None,
) -> torch.Tensor:
    """Greedy, or a sample from softmax(logits / temperature) restricted to the top k.

    Sampling is ``argmax(probs / E)`` with ``E ~ Exp(1)`` drawn on the host from ``gen``: the
    same draw ``torch.multinomial`` (hence transformers' ``generate``) makes on the CPU for
    the same seed, identical on every rank, uploaded as data (the graph never changes)."""
    if not do_sample:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    noise = torch.empty(logits.shape, dtype=torch.float32).exponential_(generator=gen)
    return (logits.softmax(-1) / noise.to(logits.device)).argmax(-1)


def attention_mask_4d(pad_mask: torch.Tensor, cache_pos: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, queries, cache]`` boolean mask built in the graph from device tensors:
    causal over cache positions, padding excluded, every query sees itself (padding rows
    would otherwise be empty and produce NaN keys/values in later layers)."""
    kv = torch.arange(pad_mask.shape[-1], device=pad_mask.device)
    q = cache_pos[:, None]
    allowed = (kv[None, :] <= q) & pad_mask.bool()[:, None, :]  # [batch, q, cache]
    return (allowed | (kv[None, :] == q))[:, None]


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    buckets: list[int],
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    pad_id: int = 0,
) -> list[list[int]]:
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
        raise ValueError(
            f"cache of {total} positions (largest bucket + new tokens rounded up "
            f"to {CACHE_ROUND}) exceeds max_position_embeddings={limit}"
        )
    batch = len(prompts)
    ids = torch.full((batch, bucket), pad_id, dtype=torch.long)
    mask = torch.ones((batch, total), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, bucket - len(p) :] = torch.tensor(p)
        mask[i, : bucket - len(p)] = 0
    pos = (mask[:, :bucket].cumsum(-1) - 1).clamp(min=0)
    gen = torch.Generator().manual_seed(seed)  # not the global RNG: ranks may be threads
    ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
    cache = StaticCache(config=model.config, max_cache_len=total)
    cache_pos = torch.arange(bucket, device=dev)
    out = model(
        input_ids=ids,
        attention_mask=attention_mask_4d(mask, cache_pos),
        position_ids=pos,
        cache_position=cache_pos,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    tok = _choose(out.logits[:, -1], do_sample, temperature, top_k, gen)
    # Tokens go into a device buffer as wide as the cache (not as the token count), at a
    # device-side index: the decode graph is the same at every step and for any length.
    buf = torch.zeros((batch, total), dtype=torch.long, device=dev)
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    buf.index_copy_(1, slot, tok[:, None])
    # Decode inputs uploaded from the host (not sliced from bucket-shaped tensors), so the
    # decode graph is one and the same for every bucket and every step.
    pos = torch.tensor([[len(p)] for p in prompts]).to(dev)
    cache_pos = torch.tensor([bucket]).to(dev)
    step_boundary(dev)
    for _ in range(max_new_tokens - 1):
        out = model(
            input_ids=tok[:, None],
            attention_mask=attention_mask_4d(mask, cache_pos),
            position_ids=pos,
            cache_position=cache_pos,
            past_key_values=cache,
            use_cache=True,
        )
        tok = _choose(out.logits[:, -1], do_sample, temperature, top_k, gen)
        slot = slot + 1
        buf.index_copy_(1, slot, tok[:, None])
        pos, cache_pos = pos + 1, cache_pos + 1
        step_boundary(dev)
    return buf.cpu()[:, :max_new_tokens].tolist()


def checkpoint_path(path: str) -> str | None:
    """The neuron_tp checkpoint ``path`` names: a step directory, or the newest one under a
    run's output (or checkpoints) directory; None when ``path`` is not one (e.g. a HF dir)."""
    from .. import checkpoint

    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    if os.path.exists(os.path.join(path, "meta.json")):
        return path
    return checkpoint.latest(path) or checkpoint.latest(os.path.join(path, "checkpoints"))


def load_checkpoint_model(path: str, mesh, dtype: torch.dtype = torch.float32):
    """A causal LM built from the config recorded in neuron_tp checkpoint ``path``, sharded
    over ``mesh`` (any tp: resharded on load) with the checkpoint's weights. The full model is
    never built: parameters are created on the meta device, sharded, then filled."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from .. import checkpoint, hf
    from ..hf.loading import _params_on_meta

    meta = checkpoint.read_meta(path)
    recorded = meta.get("model") or {}
    cfg = recorded.get("config") or {}
    if cfg.get("model_type") not in CONFIG_MAPPING:
        raise ValueError(
            f"{path}: the checkpoint records no transformers model config "
            f"(model_type {cfg.get('model_type')!r}); generation needs a checkpoint "
            "of a transformers causal LM"
        )
    config = CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
    with _params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if recorded.get("class") not in (None, type(model).__name__):
        raise ValueError(
            f"{path}: a checkpoint of {recorded['class']}, not of a causal LM "
            f"({type(model).__name__}); generation needs a causal LM"
        )
    hf.parallelize(model, mesh)
    made: dict[int, tuple] = {}  # old id -> (old, new): tied parameters stay tied
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = (
                        p,
                        torch.nn.Parameter(
                            torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad
                        ),
                    )
                mod._parameters[name] = made[id(p)][1]
    checkpoint.load(path, model, mesh=mesh, restore_rng=False)
    return model


def load_for_generation(args: GenerateConfig | argparse.Namespace, mesh):
    """The model named by ``--model`` sharded over ``mesh``, and the tokenizer: a preset
    (random init from the seed), a local HF directory (read slice by slice) or a neuron_tp
    checkpoint (at any tp)."""
    from .. import hf
    from .data import load_tokenizer, vocab_size
    from .presets import PRESETS, build_model, is_preset

    config = GenerateConfig.from_args(args)
    tok = load_tokenizer(config.tokenizer)
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
    if not is_preset(config.model) and not os.path.exists(config.model):
        raise ValueError(
            f"--model {config.model!r} is neither a preset ({', '.join(PRESETS)}) "
            "nor a local directory (a HuggingFace model or a neuron_tp checkpoint)"
        )
    if is_preset(config.model):
        from .runtime import BUILD_LOCK

        with BUILD_LOCK:  # seeds and draws the global RNG, shared by a process's threads
            full = build_model(config.model, vocab_size(tok), config.seed, dtype)
        model = hf.parallelize(full, mesh)
    elif (ckpt := checkpoint_path(config.model)) is not None:
        model = load_checkpoint_model(ckpt, mesh, dtype)
    else:
        model = hf.from_pretrained(config.model, mesh, torch_dtype=dtype)
    return model.eval(), tok


def run_cli(args: GenerateConfig | argparse.Namespace) -> list[str]:
    """``neuron-tp generate``: print each prompt's continuation (rank 0). The ranks first
    agree on every option, the prompts and library versions (one small all-gather)."""
    from .. import agreement
    from ..mesh import init_mesh
    from .runtime import rank_device, refuse_xla_ranks_off_neuron

    config = GenerateConfig.from_args(args)
    refuse_xla_ranks_off_neuron(config.device)
    world = agreement.world_group()
    error, values, prompts = None, {}, list(config.prompt)
    try:  # local work only: a failure here is shared with every rank by the check below
        if config.prompts_file:
            from .data import read_text

            prompts += [ln for ln in read_text(config.prompts_file).split("\n") if ln.strip()]
        if not prompts:
            raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
        values = config.option_values()
        values.update({"prompts": prompts, "library versions": agreement.versions()})
    except Exception as e:  # noqa: BLE001 - re-raised on this rank by check_agreement
        error = e
    agreement.check_agreement(values, world, error=error, what="neuron-tp generate")
    device = rank_device(config.device)
    mesh = init_mesh(tp=config.tp)
    model, tok = load_for_generation(config, mesh)
    move_to(model, device)  # keeps tied embeddings tied
    encoded = [tok.encode(p) for p in prompts]
    pad = getattr(tok, "pad_token_id", None) or 0
    out = generate(
        model,
        encoded,
        config.max_new_tokens,
        config.buckets,
        config.do_sample,
        config.temperature,
        config.top_k,
        config.seed,
        pad,
    )
    texts = [tok.decode(o) for o in out]
    if mesh.rank == 0:
        for p, t in zip(prompts, texts):
            print(f"{p!r} -> {t!r}")
        print(f"graph compiles: {graph_counters()['compiles']}")
    return texts

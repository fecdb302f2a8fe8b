"""transformers' own sampling on the unsharded model: the reference of sampled generation."""

from __future__ import annotations

import torch


def hf_sample(full, prompts, new: int, temperature: float, top_k: int, seed: int, **generate):
    """transformers' own sampling on the unsharded model: the batch left-padded, same seed
    (``generate``: more arguments of ``full.generate``, e.g. ``eos_token_id``)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    torch.manual_seed(seed)
    out = full.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=1.0,
        pad_token_id=0,
        **generate,
    )
    return out[:, width:].tolist()

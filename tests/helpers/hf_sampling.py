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


def peaked(model, scale: float = 15.0):
    """``model`` with its output head scaled in place by ``scale`` (returned): a random tiny
    model's logits are nearly uniform (spread ~0.4), so a wrong temperature (``logits * T``
    for ``logits / T``) would sample the same tokens; scaled, they spread over several units
    and the temperature decides which token is drawn."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model

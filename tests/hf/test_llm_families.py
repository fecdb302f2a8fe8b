"""The modern decoder-only families the sweep (tests/hf/test_dense_families.py, tp 2) found
exact, at tp 4 on gloo ranks, with and without sequence parallelism, in ONE launch: logits,
parallel loss, every gradient and the logits after one SGD step equal the unsharded
transformers model's (and, for a family with dropout, in training mode from the same RNG
state). Gemma-3/3n/4 (sliding and global layers, KV sharing, per-layer inputs), Qwen-3.5 and
Falcon-H1 (their recurrent mixers replicated; no sequence parallelism), GPT-J, MiniCPM3's
latent attention. MQA with one kv head replicated on every rank (StarCoder), ALiBi slopes of each
rank's heads (BLOOM, MPT), attention sinks split by heads (Granite-SWA), CodeGen's 4-block qkv,
Gemma-3's text config. The configurations neuron_tp cannot shard exactly are refused before
anything is changed, with the reason. A sample (BLOOM, StarCoder, Granite-SWA) also runs on 2
XLA CPU devices."""

from __future__ import annotations

import copy
import json
import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "helpers"))
sys.path.insert(0, HERE)
import test_dense_families as sweep  # noqa: E402

import gloo_dist  # noqa: E402
from dense_families import build_dense, drops  # noqa: E402

TP = 4
# name -> (model_type, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "stablelm": ("stablelm", {}),
    "persimmon": ("persimmon", {}),
    "gpt_bigcode": ("gpt_bigcode", {}),  # multi-query: 1 kv head on every rank
    "gpt_bigcode mha": ("gpt_bigcode", {"multi_query": False}),
    "mpt": ("mpt", {}),
    "bloom": ("bloom", {}),
    "gemma3": ("gemma3", {}),
    "gemma3n": ("gemma3n_text", {}),  # KV-shared layers, per-layer inputs
    "gemma4": ("gemma4_text", {}),
    "qwen3_5": ("qwen3_5_text", {}),  # linear-attention (Gated DeltaNet) and full layers
    "falcon_h1": ("falcon_h1", {}),  # attention and Mamba mixers side by side
    "gptj": ("gptj", {}),
    "minicpm3": ("minicpm3", {}),  # multi-head latent attention
    "granite_swa": ("granite_swa", {}),
    "xglm": ("xglm", {}),
    "bitnet": ("bitnet", {}),  # RMSNorms over split features before o_proj / down_proj
    # 4 query heads per rank at tp 4
    "codegen": (
        "codegen",
        {"n_head": 16, "num_attention_heads": 16, "n_embd": 64, "hidden_size": 64},
    ),
}
# Sequence parallelism refused (with this reason) for these.
NO_SP = {
    "xglm": "sequence_parallel needs column-parallel projections inside an attention",
    "gemma3n": "a stack of residual streams (AltUp",
    "qwen3_5": "mixes tokens along the sequence",
    "falcon_h1": "mixes tokens along the sequence",
}
# Refused whatever the options: name -> (model_type, overrides, words of the reason).
REFUSED: dict[str, tuple[str, dict, str]] = {
    "stablelm qk_layernorm": ("stablelm", {"qk_layernorm": True}, "qk_layernorm"),
    "xglm attention dropout": ("xglm", {"attention_dropout": 0.1}, "attention_dropout"),
    "bloom slow_but_exact": (
        "bloom",
        {"pretraining_tp": 2, "slow_but_exact": True},
        "slow_but_exact",
    ),
    "codegen 2 heads per rank": ("codegen", {}, "multiple of 4"),
    "big_bird block-sparse": ("big_bird", {"attention_type": "block_sparse"}, "block-sparse"),
}


def _sp_compare(ref) -> list[str]:
    """With sequence parallelism: the eval comparison, and the training one for a family
    with dropout."""
    from neuron_tp.hf import parallelize

    sp = parallelize(copy.deepcopy(ref), parallel_loss=True, sequence_parallel=True)
    bad = sweep._compare(copy.deepcopy(ref), sp)
    if not bad and drops(ref):
        sp = parallelize(copy.deepcopy(ref), parallel_loss=True, sequence_parallel=True)
        bad = sweep._compare_training(copy.deepcopy(ref), sp, "sp ")
    return bad


def _case(name: str) -> dict[str, str]:
    mt, overrides = CASES[name]
    ref = build_dense(mt, **overrides)
    out = {"tp": "{} {}".format(*sweep._try(ref))}
    try:
        bad = _sp_compare(ref)
        out["sp"] = "; ".join(bad[:3]) or "exact"
    except ValueError as e:
        out["sp"] = f"refused {str(e)[:200]}"
    return out


def _sweep(out_path: str) -> None:
    import torch.distributed as dist

    gloo_dist.shared_mesh(TP)
    results: dict[str, dict[str, str]] = {}
    for name in CASES:
        results[name] = _case(name)
    for name, (mt, overrides, _) in REFUSED.items():
        results[name] = {"tp": "{} {}".format(*sweep._try(build_dense(mt, **overrides)))}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, results)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(every, f, indent=1)


def test_modern_families_at_tp4(tmp_path):
    out = str(tmp_path / "tp4.json")
    gloo_dist.run(_sweep, out, world_size=TP, timeout=600)
    with open(out) as f:
        ranks = json.load(f)
    for r, results in enumerate(ranks):
        for name, got in results.items():
            print(f"rank {r} {name:26s} {got}")
        for name in CASES:
            assert results[name]["tp"] == "exact ", (name, results[name])
            if name in NO_SP:
                assert results[name]["sp"].startswith("refused"), (name, results[name])
                assert NO_SP[name] in results[name]["sp"], (name, results[name])
            else:
                assert results[name]["sp"] == "exact", (name, results[name])
        for name, (_, _, why) in REFUSED.items():
            got = results[name]["tp"]
            assert got.startswith("refused ") and why in got, (name, got)


def test_modern_families_on_xla_devices():
    """BLOOM, StarCoder and Granite-SWA at tp 2 on 2 XLA CPU devices: logits, loss, every
    gradient equal the unsharded model's (tests/hf/llm_xla_cases.py)."""
    import llm_xla_cases

    import xla_dist

    (r0, r1) = xla_dist.run(llm_xla_cases.job, devices=2)
    assert r0["checks"] == r1["checks"] and len(r0["checks"]) > 30

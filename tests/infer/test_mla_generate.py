"""Generation with multi-head latent attention sharded by heads (:mod:`neuron_tp.hf.mla`;
the cache holds the replicated latents): on 2 gloo ranks (tp=2) the static generator's
(``neuron-tp generate``) greedy tokens and the slot generator's (``neuron-tp serve``: requests
admitted and ended by a random schedule) equal transformers' own ``generate`` on the unsharded
MiniCPM3 and DeepSeek-V3 tiny models."""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
import gloo_dist  # noqa: E402
from dense_families import build_dense  # noqa: E402
from moe_families import build_family  # noqa: E402
from slot_trace import Req, reference, run_schedule  # noqa: E402

PROMPTS = [[5, 9, 13], [7, 1, 30, 22, 41, 3, 8], list(range(20, 31))]
NEW = 8


def _generate(tmp: str) -> None:
    import neuron_tp as ntp
    from neuron_tp import hf
    from neuron_tp.infer.sampling import Sampling
    from neuron_tp.infer.slot_generator import SlotGenerator
    from neuron_tp.infer.static_generator import generate

    mesh = ntp.init_mesh(tp=2)
    res = {}
    pos = dict(max_position_embeddings=256, num_key_value_heads=4)  # MLA: one k/v per head
    models = (
        ("minicpm3", build_dense("minicpm3", **pos)),
        ("deepseek_v3", build_family("deepseek_v3", **pos)),
    )
    for family, full in models:
        model = hf.parallelize(copy.deepcopy(full), mesh).eval()
        res[family] = generate(model, PROMPTS, NEW, [8, 16])
        res[f"{family} ref"] = [
            full.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in PROMPTS
        ]
        reqs = [Req(p, NEW - i, Sampling()) for i, p in enumerate(PROMPTS * 2)]
        gen = SlotGenerator(model, 2, max_len=32, chunk=8)
        res[f"{family} slots"] = run_schedule(gen, reqs, 5)
        res[f"{family} slots ref"] = [reference(full, r) for r in reqs]
    res["cli"], res["cli ref"] = _cli(tmp, mesh)
    with open(f"{tmp}/gen-{mesh.rank}.json", "w") as fh:
        json.dump(res, fh)


def _cli(tmp: str, mesh) -> tuple[list[str], list[str]]:
    """``neuron-tp generate --tp 2`` on a saved MiniCPM3 directory (each rank loads its slices)
    and transformers' greedy text of the unsharded model."""
    from neuron_tp import hf
    from neuron_tp.cli.args import generate_parser
    from neuron_tp.infer.generate_command import run_cli

    full = build_dense(
        "minicpm3", vocab_size=257, max_position_embeddings=256, num_key_value_heads=4
    )
    hf.save_pretrained(hf.parallelize(copy.deepcopy(full), mesh), f"{tmp}/model")
    torch.distributed.barrier()  # rank 0 writes
    texts = ["The old", "A"]
    argv = ["--device", "cpu", "--tp", "2", "--model", f"{tmp}/model", "--tokenizer", "bytes"]
    argv += [a for t in texts for a in ("--prompt", t)]
    got = run_cli(generate_parser().parse_args([*argv, "--max-new-tokens", "6", "--buckets", "8"]))
    want = []
    for t in texts:
        ids = torch.tensor([list(t.encode())])
        out = full.generate(
            ids, max_new_tokens=6, do_sample=False, eos_token_id=256, pad_token_id=0
        )
        want.append(
            bytes(i for i in out[0, ids.shape[1] :].tolist() if i < 256).decode("utf-8", "replace")
        )
    return got, want


def test_latent_attention_generation_matches_transformers(tmp_path):
    gloo_dist.run(_generate, str(tmp_path), world_size=2)
    r0, r1 = (json.loads((tmp_path / f"gen-{r}.json").read_text()) for r in range(2))
    assert r0 == r1
    for family in ("minicpm3", "deepseek_v3"):
        assert r0[family] == r0[f"{family} ref"], family
        assert r0[f"{family} slots"] == r0[f"{family} slots ref"], family
        assert len({tuple(t) for t in r0[f"{family} ref"]}) == len(PROMPTS), "not telling"
    assert r0["cli"] == r0["cli ref"] and all(r0["cli"]), r0["cli"]


def test_generation_refused_with_a_sparse_attention_indexer():
    """DeepSeek-V3.2's indexer keeps its own cache (its top-k keys), which the slot cache does
    not hold: the cache layout refuses the model by name before any slot is allocated."""
    import pytest

    from neuron_tp.errors import UserError
    from neuron_tp.infer.slot_cache import kv_tensor_shapes

    with pytest.raises(UserError, match="sparse-attention indexer"):
        kv_tensor_shapes(build_family("deepseek_v32"))
    assert kv_tensor_shapes(build_family("deepseek_v3"))  # the same MLA without one: allowed

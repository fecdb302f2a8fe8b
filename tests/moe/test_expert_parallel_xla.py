"""Expert parallelism EXECUTED on 2 XLA CPU devices (one launch): ep 2, dropless and with a
capacity that drops, against the loop over experts on unsharded weights (ep_cases.py), outputs
and gradients; a step with different tokens and routing compiles no new graph. Then a tiny
Qwen3-MoE parallelized with ep 2 trains 3 steps against transformers on the global batch
(ep_model_xla.py): losses and gradients equal, no new graph after the first step; and with
ZeRO-1 (experts' AdamW state cut over edp): losses, clipped norms, weights after the steps;
and gpt-oss, Llama-4 text and MiniMax-M2 (experts behind transformers' interface: three router
styles, biased / transposed / dense-call experts) train 2 steps under ep 2: losses and
gradients equal, no new graph in the second step."""

from __future__ import annotations

import ep_cases

import xla_dist


def test_expert_parallel_xla_devices():
    results = xla_dist.run(ep_cases.xla_job, devices=2, timeout=600)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["checks"] == 6 * len(ep_cases.XLA_CASES) for r in results)
    assert all(r["new_compiles"] == 0 for r in results), results
    for r in results:
        model = r["model"]
        assert max(model["loss"] + model["grad"]) < 5e-5, model
        compiles = model["compiles"]  # after each step: none after the first
        assert compiles == [compiles[0]] * len(compiles), compiles
        for fam, res in r["families"].items():  # behind transformers' experts interface
            assert max(res["loss"] + res["grad"]) < 5e-5, (fam, res)
            assert res["compiles"] == [res["compiles"][0]] * len(res["compiles"]), (fam, res)
        zero1 = r["zero1"]
        assert max(zero1["loss"] + zero1["norm"] + [zero1["weights"]]) < 1e-4, zero1

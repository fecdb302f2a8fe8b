"""The XLA path EXECUTED on several XLA CPU devices (xmp.spawn, one thread per device; harness
xla_dist.py, cases xla_multi_model_cases.py), each case against an unsharded CPU reference:

* 1D ``TransformerBlock`` at tp 4 and tp2 x dp2, with and without sequence parallelism:
  output, input grad, every gathered parameter and gradient (SP grad sync, dp averaging),
  ``global_grad_norm`` and ``clip_grad_norm_``;
* ``TransformerBlockND`` at 2D q=2 (tp 4, and tp 4 x dp 2) and 3D q=2 (tp 8), plus a 2D / 3D
  embedding -> block -> norm -> classifier -> cross-entropy model;
* patched HF models (Llama with 8 q / 2 kv heads: kv rows replicated at tp 4; GPT-2 with its
  tied head; Falcon multi-query at tp 4: one kv head replicated on every rank), with and
  without SP: full logits, then loss and every gradient in HF names with
  ``parallel_loss=True``; Llama and GPT-2 at tp2 x dp2 (the architectures' own code is proven
  on gloo ranks by tests/hf/test_hf_parallelize.py; here the XLA collectives under them).

One process per device count (process start and compiles dominate the run time)."""

from __future__ import annotations

import re

import xla_multi_model_cases as cases

import xla_dist

SP = (False, True)


def _run(plan: list[tuple], world: int) -> None:
    results = xla_dist.run(cases.job, plan, devices=world)
    assert [r["rank"] for r in results] == list(range(world))
    assert all(r["world"] == world for r in results)
    names = [[re.sub(r" \[rank \d+\]", "", w) for w in r["checks"]] for r in results]
    assert all(n == names[0] for n in names), "ranks ran different checks"
    for entry in plan:  # every case checked something (out, grads, ...) on every rank
        kind, tp = entry[0], entry[1]
        tag = {
            "1d": f"1D block tp={tp} ",
            "nd": f"{entry[2]} block tp={tp} ",
            "hf": f"HF {entry[2]} tp={tp} 1d ",
            "hfnd": f"HF {entry[-1]} tp={tp} {entry[2]} ",
        }[kind]
        assert sum(n.startswith(tag) for n in names[0]) >= 10, (entry, names[0])


def test_four_devices_tp4_tp2xdp2_2d():
    # tp 2 runs as tp2 x dp2 (two tp groups, dp averaging): what a 2-device launch would
    # add is the same collectives over one group. SP off / on alternate over the cases.
    _run(
        [("1d", 4, True), ("1d", 2, False)]
        + [("nd", 4, "2d", 2, True), ("hfnd", 4, "2d", "llama")]
        # Llama 8 q / 2 kv heads: kv rows replicated at tp 4; Falcon's one kv head on every rank
        + [("hf", 4, "llama", True), ("hf", 4, "falcon", False)]
        + [("hf", 2, "llama", True), ("hf", 2, "gpt2", True)]
        + [("hf", 2, "llama", "keep")],  # SP keeping the gathered inputs (no re-gather)
        4,
    )


def test_eight_devices_3d_and_2d_dp2():
    _run(
        [
            ("nd", 8, "3d", 4, True),
            ("hfnd", 8, "3d", "llama"),
            ("nd", 4, "2d", 2, False, False),  # 2D x dp 2 keeping the gathered operands
        ],
        8,
    )

"""Pipeline training on 4 gloo ranks, one launch for every case (pipeline_cases.py): pp 2 x
tp 2 (with and without sequence parallelism), pp 4 on packed rows then evaluated, interleaved
(v 2) with tied embeddings then evaluated, pp 2 x dp 2 with ZeRO-1 and tied embeddings, and MoE
models cut into stages (Mixtral at pp 2 x dp 2, Qwen2-MoE with its shared expert and a dense
layer at pp 2 x tp 2), both also with their router load-balancing loss (Qwen2-MoE also
interleaved: v 2, a piece holding only the dense layer), and Mixtral at pp 2 x dp 2 with its
experts over ep 2 inside each stage (router loss on; the trained stages saved, loaded back and
consolidated), against the unsharded model; a stage of pp 2 x tp 2 loaded from a HF directory
reading only its own tensors; and stacks of the layer library's blocks cut into stages
(tests/helpers/block_pipeline.py: 1D with SP at pp 2 x tp 2, 2D interleaved at pp 2 x dp 2)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pipeline_cases
import pytest
import torch.distributed as dist

import block_pipeline
import gloo_dist

CASES = (
    "pp2_tp2",
    "pp2_tp2_sp",
    "pp4_packed_eval",
    "pp2_cp2_packed_eval",
    "pp2_tp2_bw_packed_eval",
    "pp2_cp2_tied_zero1",
    "pp2_tp2_tied_v2_eval",
    "pp2_tied_zero1",
    "pp2_moe",
    "pp2_tp2_qwen2moe",
    "pp2_moe_aux",
    "pp2_tp2_qwen2moe_aux",
    "pp2_v2_qwen2moe_aux",
    "pp2_ep2_moe_aux_ckpt",
    "load_pp2_tp2",
    "blocks_pp2_tp2_sp",
    "blocks2d_pp2_dp2_v2",
)


def check(case: str) -> None:
    if case.startswith("blocks"):
        checked = block_pipeline.run(case)
        assert any(c.startswith("grad blocks.") for c in checked), checked
        return
    if case.startswith("load"):
        pipeline_cases.load_stage(case)
        return
    root = None
    if case.endswith("_ckpt"):  # one directory for every rank (gloo ranks: processes)
        root = os.path.join(tempfile.gettempdir(), f"ntp-pp-ckpt-{os.getppid()}")
    try:
        out = pipeline_cases.run(case, checkpoint_root=root)
    finally:
        if root is not None:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(f"{root}-hf", ignore_errors=True)
    assert (root is None) or any(c.startswith("loaded ") for c in out["checked"]), out
    assert any(c.startswith("grad ") for c in out["checked"]), out
    assert any(c.startswith("weight ") for c in out["checked"]), out
    assert ("eval" in out["checked"]) == ("_eval" in case), out


@pytest.mark.parametrize("case", CASES)
def test_pipeline_gloo(case):
    gloo_dist.run_case(check, case, cases=CASES, world_size=4)

"""``stages_of_blocks`` on one process (no collective runs): the stage keeps its own blocks,
the boundary shape follows the blocks' residual layout (1D, SP, 2D, 3D), and the refusals
(layouts that differ along the stack, a tied head, a plan of another length, packed rows)
raise a UserError naming what is wrong before any collective. The numerics of block stacks at
pp are proven on gloo ranks: tests/helpers/block_pipeline.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import neuron_tp as ntp
from neuron_tp.blocks import TransformerBlock
from neuron_tp.errors import UserError
from neuron_tp.layers import ColumnParallelLinear, VocabParallelEmbedding
from neuron_tp.layers.activation_layout import (
    LAYOUT_2D,
    LAYOUT_3D_A,
    REPLICATED,
    SHARDED_SEQUENCE,
)
from neuron_tp.pipeline import BlockStage, PipelineRunner, schedule, stages_of_blocks
from neuron_tp.pipeline.stages import plan_stages

MESH = ntp.Mesh(1, 0)  # one rank: tp and pp of 1


def _model(sp: bool = False, n: int = 4, block_sp: bool | None = None):
    emb = VocabParallelEmbedding(32, 8, sequence_parallel=sp, mesh=MESH)
    sp_blocks = sp if block_sp is None else block_sp
    blocks = [TransformerBlock(8, 2, mesh=MESH, sequence_parallel=sp_blocks) for _ in range(n)]
    head = nn.Sequential(
        nn.LayerNorm(8), ColumnParallelLinear(8, 32, sequence_parallel=sp, mesh=MESH)
    )
    return emb, blocks, head


def test_one_stage_keeps_everything_and_trains_a_step():
    emb, blocks, head = _model()
    stage = stages_of_blocks(blocks, MESH, plan_stages(4, 1), embedding=emb, head=head)
    assert sorted(stage.model.blocks) == ["0", "1", "2", "3"]
    assert stage.model.embedding is emb and stage.model.head is head
    runner = PipelineRunner(stage, schedule.build("1f1b", 1, 2), batch=2, seq=6, device="cpu")
    ids = torch.randint(0, 32, (2, 2, 6), generator=torch.Generator().manual_seed(0))
    loss = runner.step([{"input_ids": x, "labels": x} for x in ids], torch.tensor([1.0]))
    h = emb(ids.flatten(0, 1))
    for b in blocks:
        h = b(h)
    logits = head(h)[:, :-1]
    want = nn.functional.cross_entropy(logits.reshape(-1, 32), ids.flatten(0, 1)[:, 1:].flatten())
    torch.testing.assert_close(float(loss), float(want.detach()) * 20, rtol=1e-5, atol=1e-5)
    assert all(p.grad is not None for p in stage.model.parameters())


@pytest.mark.parametrize(
    "tp, mode, residual, shape",
    [
        (2, "1d", REPLICATED, (4, 8, 12)),
        (2, "1d", SHARDED_SEQUENCE, (4, 4, 12)),
        (4, "2d", LAYOUT_2D, (2, 8, 6)),
        (8, "3d", LAYOUT_3D_A, (1, 8, 6)),
    ],
)
def test_boundary_shape_is_the_residual_layout_block(tp, mode, residual, shape):
    mesh = ntp.Mesh(tp * 2, 0, tp=tp, tp_mode=mode, pp=2, virtual=True)
    stage = BlockStage(None, plan_stages(4, 2), 0, mesh, None, residual=residual, hidden=12)
    assert stage.boundary_shape(4, 8) == shape
    assert stage.boundary_shape(4, 8, residual == SHARDED_SEQUENCE) == shape
    with pytest.raises(ValueError, match="sequence_parallel"):
        stage.boundary_shape(4, 8, residual != SHARDED_SEQUENCE)


def test_refusals_name_what_is_wrong():
    emb, blocks, head = _model(sp=True, block_sp=False)
    with pytest.raises(UserError, match=r"one layout.*block 0 input: replicated"):
        stages_of_blocks(blocks, MESH, plan_stages(4, 1), embedding=emb, head=head)
    emb, blocks, head = _model()
    with pytest.raises(UserError, match="covers 2 blocks, the stack has 4"):
        stages_of_blocks(blocks, MESH, plan_stages(2, 1), embedding=emb, head=head)
    tied = nn.Sequential(nn.LayerNorm(8), ColumnParallelLinear(8, 32, bias=False, mesh=MESH))
    tied[1].weight = emb.weight
    with pytest.raises(UserError, match="tied to the embedding"):
        stages_of_blocks(blocks, MESH, plan_stages(4, 1), embedding=emb, head=tied)
    stage = stages_of_blocks(blocks, MESH, plan_stages(4, 1), embedding=emb, head=head)
    runner = PipelineRunner(stage, schedule.build("1f1b", 1, 1), batch=1, seq=4, device="cpu")
    packed = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "segment_ids": torch.ones(1, 4)}
    packed["labels"] = packed["input_ids"]
    with pytest.raises(UserError, match="packed rows"):
        runner.step([packed], torch.tensor([1.0]))

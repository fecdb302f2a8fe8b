"""Every layer (and HF sequence-parallel hook) declares the activation layouts it takes and
returns, as ``input_layout`` / ``output_layout``, and the declaration follows its options.
Construction only: a mesh without process groups is enough (no collective runs)."""

from __future__ import annotations

import pytest
from torch import nn

import neuron_tp as ntp
from neuron_tp import blocks
from neuron_tp.blocks import block_nd as blocks_nd
from neuron_tp.hf.attention import ShardedRMSNorm
from neuron_tp.hf.modules import HFColumnLinear, ScaledVocabParallelEmbedding
from neuron_tp.hf.sequence_parallel import (
    GatherSequence,
    ScatterSequence,
    SharedInputRegion,
    install_input_region,
)
from neuron_tp.layers import nd
from neuron_tp.layers.activation_layout import REPLICATED, SHARDED_FEATURES, SHARDED_SEQUENCE

MESH_1D = ntp.Mesh(2, 0, tp=2)
MESH_2D = ntp.Mesh(4, 0, tp=4, tp_mode="2d")
MESH_3D = ntp.Mesh(8, 0, tp=8, tp_mode="3d")


def _layouts(obj) -> tuple:
    return obj.input_layout, obj.output_layout


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("gather", [False, True])
def test_column_parallel_linear(sp, gather):
    layer = ntp.ColumnParallelLinear(
        8, 8, gather_output=gather, sequence_parallel=sp, mesh=MESH_1D, device="meta"
    )
    assert _layouts(layer) == (
        SHARDED_SEQUENCE if sp else REPLICATED,
        REPLICATED if gather else SHARDED_FEATURES,
    )


@pytest.mark.parametrize("sp,parallel_in", [(False, False), (False, True), (True, True)])
def test_row_parallel_linear(sp, parallel_in):
    layer = ntp.RowParallelLinear(
        8, 8, input_is_parallel=parallel_in, sequence_parallel=sp, mesh=MESH_1D, device="meta"
    )
    assert _layouts(layer) == (
        SHARDED_FEATURES if parallel_in else REPLICATED,
        SHARDED_SEQUENCE if sp else REPLICATED,
    )


@pytest.mark.parametrize("cls", [ntp.VocabParallelEmbedding, ScaledVocabParallelEmbedding])
@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_embedding(cls, sp):
    layer = cls(10, 8, sequence_parallel=sp, mesh=MESH_1D, device="meta")
    assert _layouts(layer) == (REPLICATED, SHARDED_SEQUENCE if sp else REPLICATED)


@pytest.mark.parametrize("sp", [False, True])
def test_hf_column_linear_and_its_shared_input_region(sp):
    layer = HFColumnLinear(8, 8, sequence_parallel=sp, mesh=MESH_1D, device="meta")
    assert _layouts(layer) == (SHARDED_SEQUENCE if sp else REPLICATED, SHARDED_FEATURES)
    parent = nn.Module()
    install_input_region(parent, [layer], MESH_1D, sp)
    (hook,) = parent._forward_pre_hooks.values()
    assert isinstance(hook, SharedInputRegion)
    # The parent's hook takes the residual stream and hands its children a replicated input.
    assert _layouts(hook) == (SHARDED_SEQUENCE if sp else REPLICATED, REPLICATED)
    assert layer.input_layout == hook.output_layout


def test_sharded_rms_norm_and_sequence_hooks():
    norm = nn.RMSNorm(8)
    assert _layouts(ShardedRMSNorm(norm, MESH_1D, 8)) == (SHARDED_FEATURES, SHARDED_FEATURES)
    assert _layouts(ScatterSequence(MESH_1D.tp)) == (REPLICATED, SHARDED_SEQUENCE)
    assert _layouts(GatherSequence(MESH_1D.tp)) == (SHARDED_SEQUENCE, REPLICATED)


@pytest.mark.parametrize("sp", [False, True])
def test_1d_blocks_chain(sp):
    block = blocks.TransformerBlock(8, 2, mesh=MESH_1D, sequence_parallel=sp)
    stream = SHARDED_SEQUENCE if sp else REPLICATED
    assert _layouts(block) == _layouts(block.mlp) == _layouts(block.attn) == (stream, stream)
    for first, second in ((block.mlp.up, block.mlp.down), (block.attn.qkv, block.attn.out)):
        assert first.input_layout == stream and second.output_layout == stream
        assert first.output_layout == second.input_layout == SHARDED_FEATURES


def test_2d_layers():
    a = nd.LAYOUT_2D
    for layer in (
        nd.Linear2D(8, 8, mesh=MESH_2D),
        nd.Classifier2D(8, 10, mesh=MESH_2D),
        nd.LayerNorm2D(8, mesh=MESH_2D),
        nd.RMSNorm2D(8, mesh=MESH_2D),
        nd.Embedding2D(10, 8, mesh=MESH_2D),
        blocks_nd.TransformerBlockND(8, 2, mesh=MESH_2D),
    ):
        assert _layouts(layer) == (a, a), type(layer).__name__


def test_3d_layers_follow_orientation_and_layout():
    a, b = nd.LAYOUT_3D_A, nd.LAYOUT_3D_B
    assert _layouts(nd.Linear3D(8, 8, orientation="ab", mesh=MESH_3D)) == (a, b)
    assert _layouts(nd.Linear3D(8, 8, orientation="ba", mesh=MESH_3D)) == (b, a)
    assert _layouts(nd.Classifier3D(8, 10, mesh=MESH_3D)) == (a, b)
    assert _layouts(nd.LayerNorm3D(8, layout="3d-b", mesh=MESH_3D)) == (b, b)
    assert _layouts(nd.RMSNorm3D(8, mesh=MESH_3D)) == (a, a)
    assert _layouts(nd.Embedding3D(8, 8, mesh=MESH_3D)) == (a, a)
    block = blocks_nd.TransformerBlockND(8, 2, mesh=MESH_3D)
    assert _layouts(block) == (a, a)
    assert block.mlp.up.output_layout == block.mlp.down.input_layout == b


def test_layouts_print_by_name():
    assert str(nd.LAYOUT_3D_B) == "3d-b" and nd.Layout is nd.ActivationLayout
    assert (REPLICATED, SHARDED_FEATURES, SHARDED_SEQUENCE) == (
        "replicated",
        "sharded(features)",
        "sharded(sequence)",
    )

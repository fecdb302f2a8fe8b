"""2D and 3D tensor parallelism divide every saved activation by P: the Linear2D / Linear3D
save only their local input and weight blocks and all-gather them again in backward
(``regather=True``, the default). Measured per rank: the saved-for-backward bytes
(storage-deduplicated, parameters left out; tests/helpers/saved_bytes.py) of a
``TransformerBlockND`` on gloo ranks against the same block unsharded (a tp=1 mesh of the same
mode: the same ops, every collective skipped) / P, with and without the re-gather."""

from __future__ import annotations

import pytest
import torch

import gloo_dist
import neuron_tp as ntp
from neuron_tp.blocks.block_nd import TransformerBlockND
from neuron_tp.layers import nd
from saved_bytes import SavedBytes

HID, HEADS, FFN, S = 512, 8, 2048, 256
LIMIT = 1.15  # x (unsharded bytes / P) with the re-gather


def _saved(mesh, batch: int, regather: bool) -> int:
    """Saved bytes of one block's forward on this rank's block of a ``[batch, S, HID]`` input."""
    torch.manual_seed(0)
    block = TransformerBlockND(HID, HEADS, FFN, mesh=mesh, regather=regather)
    torch.manual_seed(1)
    x_full = torch.randn(batch, S, HID)
    x = nd.split_input(x_full, block.input_layout, mesh).clone().requires_grad_(True)
    count = SavedBytes(block)
    with count.hooks:
        y = block(x)
    y.square().sum().backward()
    return count.total


def _memory(mode: str, tp: int, batch: int) -> None:
    unsharded = _saved(ntp.Mesh(1, 0, tp=1, tp_mode=mode), batch, True)
    mesh = ntp.init_mesh(tp=tp, tp_mode=mode)
    ratio = {r: _saved(mesh, batch, r) / (unsharded / tp) for r in (True, False)}
    if mesh.rank == 0:
        print(f"{mode} block saved bytes / (unsharded/P) at P={tp}: {ratio}", flush=True)
    assert ratio[True] <= LIMIT, ratio
    # keeping the gathered operands costs more: the re-gather is what makes the 1/P
    assert ratio[False] > 1.3 * ratio[True], ratio


@pytest.mark.parametrize("mode, tp, batch", [("2d", 4, 2), ("3d", 8, 4)], ids=["2d-P4", "3d-P8"])
def test_nd_block_saved_bytes(mode, tp, batch):
    gloo_dist.run(_memory, mode, tp, batch, world_size=tp)

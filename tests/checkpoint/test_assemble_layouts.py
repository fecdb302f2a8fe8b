"""Offline resharding (neuron_tp/checkpoint/reshard.py ``assemble``) of every 1D/2D/3D layer's
parameter layout, at degrees no test machine can launch (2D q=4: 16 ranks, 3D q=2 and 1D 4):
each saved rank's piece is cut from a random full tensor by ``neuron_tp.parallel.sharding.shard_of``
(the same rule that gives a rank its piece when it loads), and ``assemble`` of all the pieces
must give the full tensor back, padded vocabularies trimmed. A checkpoint written at q=4 thus
loads at q=2, 1D or 3D, and one written anywhere loads at q=4 (shard_of of the assembled
tensor)."""

from __future__ import annotations

import pytest
import torch

import neuron_tp as ntp
from neuron_tp.checkpoint.reshard import assemble, sharding_record
from neuron_tp.layers import nd
from neuron_tp.parallel.sharding import get_param_meta, shard_of

H, V, FFN = 32, 61, 48  # vocab 61: padded at every degree


def _layers(mesh) -> list:
    kw = dict(mesh=mesh, device="meta")
    if mesh.tp_mode == "1d":
        return [
            ntp.ColumnParallelLinear(H, FFN, **kw),
            ntp.RowParallelLinear(FFN, H, **kw),
            ntp.VocabParallelEmbedding(V, H, **kw),
        ]
    if mesh.tp_mode == "2d":
        return [
            nd.Linear2D(H, FFN, **kw),
            nd.RMSNorm2D(H, **kw),
            nd.Embedding2D(V, H, **kw),
            nd.Classifier2D(H, V, **kw),
        ]
    return [
        nd.Linear3D(H, FFN, orientation="ab", **kw),
        nd.Linear3D(FFN, H, orientation="ba", **kw),
        nd.RMSNorm3D(H, **kw),
        nd.Embedding3D(V, H, **kw),
        nd.Classifier3D(H, V, **kw),
    ]


@pytest.mark.parametrize("tp,mode", [(4, "1d"), (4, "2d"), (16, "2d"), (8, "3d")])
def test_assemble_inverts_shard_of_for_every_layout(tp, mode):
    meshes = [ntp.Mesh(tp, r, tp=tp, tp_mode=mode) for r in range(tp)]
    per_rank = [_layers(m) for m in meshes]
    checked = 0
    for i, layer in enumerate(per_rank[0]):
        for name, _ in layer.named_parameters():
            meta = get_param_meta(layer, name)
            if meta.sharding is None:
                continue
            full = torch.randn(meta.sharding.full_shape, generator=torch.Generator().manual_seed(i))
            pieces = [
                shard_of(full, get_param_meta(per_rank[r][i], name).sharding, meshes[r])
                for r in range(tp)
            ]
            assert all(p.shape == layer.get_parameter(name).shape for p in pieces)
            record = sharding_record(meta)
            got = assemble(pieces, record, tp=tp, tp_mode=mode)
            assert torch.equal(got, full), f"{type(layer).__name__}.{name} at {mode} tp={tp}"
            reads = []
            lazy = assemble(lambda r: reads.append(r) or pieces[r], record, tp=tp, tp_mode=mode)
            assert torch.equal(lazy, full) and len(set(reads)) == len(reads)
            checked += 1
    assert checked >= 3

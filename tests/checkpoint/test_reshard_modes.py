"""Checkpoints resharded between tensor-parallel modes and degrees (1D tp4 <-> 2D q2 <-> 3D q2,
1D tp2) on gloo ranks: a tiny untied Llama trained with AdamW for two steps is saved in one
layout and loaded into a differently initialised model parallelized in another; its gathered
parameters and optimizer state (HF names and shapes) equal the saved ones exactly. A 2D
checkpoint consolidates into an HF directory that ``from_pretrained`` loads with the same
logits as the unsharded model. Two launches (world 4 and world 8) cover every case."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__))))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from neuron_tp import checkpoint  # noqa: E402
from neuron_tp.hf import gather_hf_state_dict, parallelize  # noqa: E402
from neuron_tp.hf.slice_map import WHOLE, to_hf  # noqa: E402
from neuron_tp.optim.zero1 import Zero1  # noqa: E402
from neuron_tp.parallel.sharding import gather_full, named_parameter_meta  # noqa: E402
from tiny_configs import nd_config  # noqa: E402

V = 64


def _model(seed: int):
    import transformers as tf

    cfg = nd_config(vocab_size=V)
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(5))


def _build(mesh, seed: int, zero1: bool = False):
    """A Llama (weights from ``seed``) parallelized over ``mesh`` with a fresh AdamW (ZeRO-1:
    sharded over dp)."""
    m = parallelize(_model(seed), mesh)
    if zero1:
        return m, Zero1(m, mesh=mesh, lr=1e-2, weight_decay=0.1)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def _train(m, opt, steps: int = 2) -> None:
    ids = _ids()
    for _ in range(steps):
        opt.zero_grad()
        m(ids, labels=ids).loss.backward()
        opt.step()


def _gathered(m, opt, mesh) -> tuple[dict, dict]:
    """Parameters and AdamW state of ``m``, unsharded, in HF names and shapes (every rank);
    a ZeRO-1 state is joined over dp first."""
    params = gather_hf_state_dict(m, mesh)
    optim = {}
    zero1 = opt.full_state_dict()["params"] if isinstance(opt, Zero1) else None
    for name, p, meta in named_parameter_meta(m):
        for k, v in (zero1[name]["state"] if zero1 else opt.state[p]).items():
            if k != "step" and meta.sharding is not None:
                v = to_hf(gather_full(v, meta.sharding, mesh), meta.hf_layout or WHOLE)
            optim[f"{name}/{k}"] = v.detach().clone()
    assert len(optim) == 3 * len(params), sorted(optim)[:6]  # step, exp_avg, exp_avg_sq
    return params, optim


def _same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: names differ {sorted(set(got) ^ set(want))[:6]}"
    for k, w in want.items():
        g = got[k]
        assert g.shape == w.shape and torch.equal(g, w), (
            f"{what}: {k} differs (max |diff| "
            f"{(g.float() - w.float()).abs().max().item() if g.shape == w.shape else g.shape})"
        )


def _load_and_check(
    ckpt: str, mesh, want: tuple[dict, dict], what: str, zero1: bool = False
) -> None:
    """Load ``ckpt`` into a differently initialised model on ``mesh``; compare with ``want``."""
    m, opt = _build(mesh, seed=1, zero1=zero1)
    before = gather_hf_state_dict(m, mesh)
    assert any(not torch.equal(before[k], v) for k, v in want[0].items()), what
    checkpoint.load(ckpt, m, opt, mesh=mesh, restore_rng=False)
    params, optim = _gathered(m, opt, mesh)
    _same(params, want[0], f"{what} params")
    _same(optim, want[1], f"{what} optimizer state")
    _train(m, opt, steps=1)  # the loaded state trains (shapes fit the layout's layers)


def _saved(
    root: str, mesh, seed: int, zero1: bool = False
) -> tuple[str, tuple[dict, dict], torch.nn.Module]:
    """Train a model on ``mesh`` for two steps, save it under ``root``; (path, its gathered
    params and optimizer state, the model)."""
    m, opt = _build(mesh, seed, zero1)
    _train(m, opt)
    path = checkpoint.save(root, m, opt, step=2, mesh=mesh)
    return path, _gathered(m, opt, mesh), m


def _world4(tmp: str) -> None:
    """1D tp4 -> 2D q2; 2D q2 -> 1D tp4, 1D tp2 (dp 2, plain and ZeRO-1); 1D tp2 dp2 ZeRO-1
    -> 2D q2; consolidate the 2D checkpoint."""
    tp4 = ntp.init_mesh(tp=4)
    q2 = ntp.init_mesh(tp=4, tp_mode="2d")
    tp2 = ntp.init_mesh(tp=2)

    ck1, want1, _ = _saved(os.path.join(tmp, "tp4"), tp4, seed=0)
    _load_and_check(ck1, q2, want1, "1D tp4 -> 2D q2")

    ck2, want2, m2 = _saved(os.path.join(tmp, "q2"), q2, seed=2)
    assert checkpoint.read_meta(ck2)["mesh"]["tp_mode"] == "2d"
    _load_and_check(ck2, tp4, want2, "2D q2 -> 1D tp4")
    _load_and_check(ck2, tp2, want2, "2D q2 -> 1D tp2 (dp 2)")
    _load_and_check(ck2, tp2, want2, "2D q2 -> 1D tp2 (dp 2) ZeRO-1", zero1=True)

    # A ZeRO-1 state (per-(tp, dp) files, joined over dp on read) into 2D layers.
    ckz, wantz, _ = _saved(os.path.join(tmp, "tp2-zero1"), tp2, seed=4, zero1=True)
    assert checkpoint.read_meta(ckz)["optimizer"]["dp_shards"] == 2
    _load_and_check(ckz, q2, wantz, "1D tp2 dp2 ZeRO-1 -> 2D q2")

    # Offline: the optimizer state unsharded from the 2D files, and the HF directory.
    full = checkpoint.full_optimizer_state(ck2)
    _same({f"{n}/{k}": v for n, st in full.items() for k, v in st.items()}, want2[1], "merge")
    hf_dir = os.path.join(tmp, f"hf-{dist.get_rank()}")
    checkpoint.consolidate(ck2, hf_dir)  # every rank its own copy: no shared-target race
    import transformers as tf

    loaded = tf.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    _same({k: v.detach() for k, v in loaded.state_dict().items()}, want2[0], "consolidated")
    ref = _model(seed=3)
    ref.load_state_dict(want2[0])
    ids = _ids()
    with torch.no_grad():
        got, want = loaded(ids).logits, ref(ids).logits
        assert torch.equal(got, want), (got - want).abs().max()
        sharded = m2(ids).logits.as_subclass(torch.Tensor)
        torch.testing.assert_close(sharded, want, atol=1e-5, rtol=0)

    # A damaged copy of a piece replicated over "col" (not needed to assemble) is still caught.
    if dist.get_rank() == 0:
        bad = os.path.join(tmp, "q2-damaged")
        shutil.copytree(ck2, bad)
        key = "model/model.layers.0.input_layernorm.weight"
        assert checkpoint.read_meta(ck2)["params"][key[6:]]["sharding"]["splits"] == [["row", 0]]
        _damage(os.path.join(bad, "shard-tp00003.safetensors"), key)
        with pytest.raises(checkpoint.CheckpointError, match="tp00003.*input_layernorm"):
            checkpoint.consolidate(bad, os.path.join(tmp, "hf-damaged"))
        assert not os.path.exists(os.path.join(tmp, "hf-damaged"))


def _damage(shard: str, key: str) -> None:
    """Flip one bit inside tensor ``key``'s bytes (the header stays valid)."""
    data = bytearray(open(shard, "rb").read())
    n = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + n])[key]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0x01
    open(shard, "wb").write(bytes(data))


def test_reshard_1d_2d_and_consolidate(tmp_path):
    gloo_dist.run(_world4, str(tmp_path), world_size=4)


def _world8(tmp: str) -> None:
    """1D tp4 (dp 2) -> 3D q2; 3D q2 -> 2D q2 (dp 2)."""
    tp4 = ntp.init_mesh(tp=4)
    q2 = ntp.init_mesh(tp=4, tp_mode="2d")
    c2 = ntp.init_mesh(tp=8, tp_mode="3d")

    ck1, want1, _ = _saved(os.path.join(tmp, "tp4"), tp4, seed=0)
    _load_and_check(ck1, c2, want1, "1D tp4 -> 3D q2")

    ck3, want3, _ = _saved(os.path.join(tmp, "c2"), c2, seed=2)
    assert checkpoint.read_meta(ck3)["mesh"]["tp_mode"] == "3d"
    _load_and_check(ck3, q2, want3, "3D q2 -> 2D q2 (dp 2)")


def test_reshard_3d(tmp_path):
    gloo_dist.run(_world8, str(tmp_path), world_size=8, timeout=600)

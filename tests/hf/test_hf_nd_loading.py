"""``neuron_tp.from_pretrained`` on 2d / 3d meshes on gloo ranks: the model built on the meta
device, sharded with the 2D/3D layers, and each rank reading only its blocks of every tensor
from the safetensors file gives the logits and parameters of transformers' full load (then
``parallelize``); the reads are recorded to show no rank reads more than its blocks; and the
refusals (a tensor missing from the checkpoint, a tensor of the wrong shape)."""

from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from neuron_tp.hf import gather_hf_state_dict, loading, model_files, parallelize  # noqa: E402
from tiny_configs import nd_config  # noqa: E402

V_ODD = 61  # divisible by neither q=2 (LM head) nor q^2=4 (3D embedding): padded last shard


def _save(root: str) -> dict[str, str]:
    """A tiny untied Llama with an odd vocabulary saved as safetensors, plus two broken copies
    (one tensor missing, one tensor of the wrong shape)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    cfg = nd_config(vocab_size=V_ODD)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # non-trivial norm weights: a misplaced norm block shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape) + 0.5)
    dirs = {k: os.path.join(root, k) for k in ("good", "missing", "shape")}
    model.save_pretrained(dirs["good"], safe_serialization=True)
    state = load_file(os.path.join(dirs["good"], "model.safetensors"))
    for key, change in (
        ("missing", lambda s: s.pop("model.layers.1.mlp.up_proj.weight")),
        (
            "shape",
            lambda s: s.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(32, 16)}),
        ),
    ):
        cfg.save_pretrained(dirs[key])
        broken = dict(state)
        change(broken)
        save_file(broken, os.path.join(dirs[key], "model.safetensors"), metadata={"format": "pt"})
    return dirs


class _SliceRecorder:
    """A safetensors slice handle recording how many elements each read returned."""

    def __init__(self, sl, name: str, log: dict[str, int]):
        self._sl, self._name, self._log = sl, name, log

    def get_shape(self):
        return self._sl.get_shape()

    def __getitem__(self, idx):
        t = self._sl[idx]
        self._log[self._name] = self._log.get(self._name, 0) + t.numel()
        return t


class _FileRecorder:
    def __init__(self, f, log: dict[str, int]):
        self._f, self._log = f, log

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_slice(self, name: str):
        return _SliceRecorder(self._f.get_slice(name), name, self._log)

    def get_tensor(self, name: str):  # a whole read
        t = self._f.get_tensor(name)
        self._log[name] = self._log.get(name, 0) + t.numel()
        return t


def _load_recording(path: str, mesh) -> tuple[torch.nn.Module, dict[str, int]]:
    """``ntp.from_pretrained(path, mesh)`` and ``{tensor: elements read}`` of this rank."""
    log: dict[str, int] = {}
    original = model_files.open_safetensors
    model_files.open_safetensors = lambda file: _FileRecorder(original(file), log)
    try:
        return ntp.from_pretrained(path, mesh), log
    finally:
        model_files.open_safetensors = original


def _check(dirs: dict[str, str], tp: int, mode: str) -> None:
    import transformers as tf

    mesh = ntp.init_mesh(tp=tp, tp_mode=mode)
    q = math.isqrt(tp) if mode == "2d" else round(tp ** (1 / 3))
    tag = f"{mode} q={q}"
    m, log = _load_recording(dirs["good"], mesh)
    assert not any(p.is_meta for p in m.parameters()), tag
    ref = tf.AutoModelForCausalLM.from_pretrained(dirs["good"]).eval()
    par = parallelize(copy.deepcopy(ref), mesh)
    assert type(m.model.layers[0].self_attn.q_proj) is type(par.model.layers[0].self_attn.q_proj)

    ids = torch.randint(0, V_ODD, (4, 8), generator=torch.Generator().manual_seed(1))
    ids[1, 3] = V_ODD - 1  # a row of the padded last vocab shard
    with torch.no_grad():
        got, want = m(ids).logits, ref(ids).logits
        assert got.shape == (4, 8, V_ODD), (tag, got.shape)
        torch.testing.assert_close(got.as_subclass(torch.Tensor), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            got.as_subclass(torch.Tensor), par(ids).logits.as_subclass(torch.Tensor), atol=0, rtol=0
        )
    mine, theirs = gather_hf_state_dict(m), gather_hf_state_dict(par)
    full = dict(ref.named_parameters())
    assert set(mine) == set(theirs) == set(full), (tag, set(mine) ^ set(full))
    for k, p in full.items():
        assert torch.equal(mine[k], theirs[k]), f"{tag}: {k} differs from parallelize's"
        assert torch.equal(mine[k], p.detach()), f"{tag}: {k} differs from the checkpoint"

    # Only this rank's blocks were read: per tensor, at most the local parameter's elements
    # (its block, of which padding is not read), and below 1.5 / q of the tensor.
    assert set(log) == set(full), (tag, set(log) ^ set(full))
    local = dict(m.named_parameters())
    for k, n in log.items():
        total = full[k].numel()
        assert n <= local[k].numel(), f"{tag}: {k} read {n} > block {local[k].numel()}"
        assert n < total / q * 1.5, f"{tag}: {k} read {n} of {total} elements"
    read, stored = sum(log.values()), sum(p.numel() for p in full.values())
    assert read < stored / q * 1.5, (tag, read, stored)
    if mesh.rank == 0:
        print(f"{tag}: rank 0 read {read} of {stored} elements ({read / stored:.3f})")

    # A meta-device model parallelized without loading refuses to run.
    with loading.params_on_meta():
        bare = tf.AutoModelForCausalLM.from_config(ref.config)
    bare = parallelize(bare, mesh)
    with pytest.raises(ValueError, match="still on the meta device"):
        bare(ids)

    with pytest.raises(ValueError, match="checkpoint has no tensor 'model.layers.1.mlp.up_proj"):
        ntp.from_pretrained(dirs["missing"], mesh)
    with pytest.raises(ValueError, match=r"o_proj.weight: checkpoint tensor has shape \(32, 16\)"):
        ntp.from_pretrained(dirs["shape"], mesh)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return _save(str(tmp_path_factory.mktemp("nd_loading")))


def test_from_pretrained_2d(dirs):
    gloo_dist.run(_check, dirs, 4, "2d", world_size=4)


def test_from_pretrained_3d(dirs):
    gloo_dist.run(_check, dirs, 8, "3d", world_size=8)

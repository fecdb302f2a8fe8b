"""Load only this rank's slices of a safetensors checkpoint; save a consolidated HF one."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import zlib

import torch
from torch import nn

from ..errors import UserError
from ..parallel.mesh import Mesh, get_mesh
from ..parallel.sharding import (
    Sharding,
    expert_split,
    gather_full,
    get_param_meta,
    named_parameter_meta,
    shard_of,
)
from ..parallel.state import mesh_of
from .lora_files import plain_name
from .moe_files import read_per_expert, stored_name
from .parallelize import parallelize
from .slice_map import WHOLE, get_slice_map, read_local, to_hf


def gather_hf_state_dict(
    model: nn.Module, mesh: Mesh | None = None, grads: bool = False
) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters, or their gradients, under their HF names, on every rank;
    without ``grads`` also the persistent buffers (replicated, e.g. an MoE router's
    ``e_score_correction_bias``), as transformers saves them.

    Collective over tp: every rank must call it. Gradients should be synced first
    (:func:`neuron_tp.sync_sequence_parallel_grads`)."""
    mesh = mesh_of(model, mesh)
    out = {}
    for name, p, meta in named_parameter_meta(model):
        t = p.grad if grads else p
        if t is None:
            continue
        full = gather_full(t, meta.sharding, mesh)
        out[name] = to_hf(full, meta.hf_layout or WHOLE) if meta.sharding else full.clone()
    if not grads:
        out.update((n, b.detach().clone()) for n, b in persistent_buffers(model))
    return out


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` for every buffer of ``model`` that belongs in its state dict."""
    out = []
    for mname, mod in model.named_modules():
        for bname, b in mod.named_buffers(recurse=False):
            if b is not None and bname not in mod._non_persistent_buffers_set:
                out.append((f"{mname}.{bname}" if mname else bname, b))
    return out


def save_pretrained(model: nn.Module, out_dir: str, mesh: Mesh | None = None) -> None:
    """Write a consolidated transformers checkpoint (config + model.safetensors) from rank 0.

    Collective over the job (every rank calls it) and returns on every rank once the files
    are written (a failure to write raises on every rank): any rank may read them next. The
    files load with plain ``AutoModel*.from_pretrained``."""
    from safetensors.torch import save_file

    from ..parallel.agreement import check_agreement

    mesh = mesh_of(model, mesh)
    state = gather_hf_state_dict(model, mesh)
    error = None
    try:
        if mesh.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            model.config.save_pretrained(out_dir)
            gen = getattr(model, "generation_config", None)
            if gen is not None:
                with contextlib.suppress(Exception):
                    gen.save_pretrained(out_dir)
            save_file(
                {k: v.contiguous() for k, v in state.items()},
                os.path.join(out_dir, "model.safetensors"),
                metadata={"format": "pt"},
            )
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by check_agreement
        error = e
    check_agreement({}, mesh.group("world"), error=error, what=f"save_pretrained({out_dir!r})")


# Held while nn.Module.register_parameter is patched: the ranks of --xla-cpu-devices are threads
# of one process, and a second builder would save (then restore) the first one's patch.
META_LOCK = threading.RLock()


@contextlib.contextmanager
def params_on_meta():
    """Create parameters on the meta device (buffers stay real: rotary tables, position ids).
    The patch of ``nn.Module.register_parameter`` is process-wide: ranks that are threads of
    one process (``--xla-cpu-devices``) take turns, or one thread could save another's patch
    as the original and leave it installed (every later parameter on the meta device); the
    parameters of other threads are left alone."""
    owner = threading.get_ident()

    def register(self, name, param):
        original(self, name, param)
        mine = threading.get_ident() == owner
        if mine and param is not None and param.device.type != "meta":
            p = self._parameters[name]
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    with META_LOCK:
        original = nn.Module.register_parameter
        nn.Module.register_parameter = register
        try:
            yield
        finally:
            nn.Module.register_parameter = original


def check_model_dir(path: str) -> None:
    """ValueError saying what ``path`` is instead, unless it is a local HF model directory."""
    if not os.path.isdir(path):
        what = "a file" if os.path.exists(path) else "does not exist"
        raise UserError(
            f"model {path!r}: {what}; neuron_tp loads a local HuggingFace model "
            "directory (config.json + *.safetensors; download it first, e.g. "
            "`huggingface-cli download ORG/NAME --local-dir DIR`)"
        )
    if not os.path.exists(os.path.join(path, "config.json")):
        if os.path.exists(os.path.join(path, "meta.json")) or os.path.isdir(
            os.path.join(path, "checkpoints")
        ):
            raise UserError(
                f"model {path!r} is a neuron_tp training checkpoint, not a "
                "HuggingFace model directory: resume it with --resume PATH, "
                "generate from it with `neuron-tp generate --model PATH`, or "
                "convert it with `neuron-tp consolidate PATH OUT`"
            )
        raise UserError(
            f"model {path!r}: no config.json; pass a HuggingFace model directory "
            "(config.json + *.safetensors)"
        )


def _open_safetensors(file: str):
    """``safe_open(file)``; ValueError naming the file when it is missing, truncated or not
    safetensors."""
    from safetensors import safe_open

    try:
        return safe_open(file, "pt")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: one clear message
        size = os.path.getsize(file) if os.path.exists(file) else None
        raise UserError(
            f"{file}: unreadable safetensors file ({size} bytes: {e}); it is "
            "missing, truncated (an interrupted download or copy?) or corrupt: "
            "copy or download it again"
        ) from None


SAMPLES, SAMPLE_BYTES = 16, 4096  # tensor-data blocks read per file by files_fingerprint


def files_fingerprint(files) -> dict[str, list]:
    """``{file name: [size, CRC32 of its safetensors header and of 16 evenly spaced 4 KiB
    blocks of its tensor data]}``: cheap (64 KiB read per file), and differs for a truncated,
    re-saved or different file, also one with the same header but other weights (each rank
    reads only its own slices, so nothing else would compare them)."""
    out = {}
    for file in sorted(set(files)):
        try:
            size = os.path.getsize(file)
            with open(file, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                crc = zlib.crc32(fh.read(min(n, 100_000_000)))
                start = 8 + n
                step = max(1, (size - start) // SAMPLES)
                for offset in range(start, size, step):
                    fh.seek(offset)
                    crc = zlib.crc32(fh.read(SAMPLE_BYTES), crc)
            out[os.path.basename(file)] = [size, crc]
        except OSError as e:
            out[os.path.basename(file)] = [None, repr(e)]
    return out


def checkpoint_files(path: str) -> dict[str, str]:
    """``{tensor name: file}`` of a single-file or sharded (index.json) safetensors checkpoint."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                wmap = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"{index}: unreadable safetensors index ({e!r}); it needs a "
                "'weight_map' of tensor name -> file"
            ) from None
        return {k: os.path.join(path, v) for k, v in wmap.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise UserError(f"{path}: no model.safetensors or model.safetensors.index.json")
    with _open_safetensors(single) as f:
        return {k: single for k in f.keys()}


def block_ranges(sharding: Sharding, mesh: Mesh) -> list[tuple[int, int]]:
    """This rank's ``[start, stop)`` along every dim of the full tensor: the block
    :func:`~neuron_tp.parallel.sharding.shard_of` gives it (``stop`` past the end = zero padding).

    Derived by running ``shard_of`` itself, one dim at a time, on the 1-based indices of that
    dim (0 = padding), so the rule (ceil chunks, splits applied outermost first, several splits
    of one dim nesting) is exactly the one the layers shard fresh weights with."""
    if sharding.segments:
        raise ValueError("block_ranges: packed (segmented) parameters are 1d-only")
    out = []
    for d, size in enumerate(sharding.full_shape):
        splits = tuple((axis, 0) for axis, dim in sharding.splits if dim == d)
        if not splits:
            out.append((0, size))
            continue
        idx = shard_of(torch.arange(1, size + 1), Sharding(splits, (size,)), mesh)
        n_real = int((idx > 0).sum())
        if n_real:
            start = int(idx[0]) - 1
            want = torch.arange(start + 1, start + 1 + n_real)
            if not torch.equal(idx[:n_real], want):  # not one contiguous range + padding
                raise AssertionError(f"dim {d} of {sharding}: non-contiguous block {idx}")
        else:
            start = size  # a block made only of padding
        out.append((start, start + idx.numel()))
    return out


def read_block(sl, shape: tuple[int, ...], sharding: Sharding | None, mesh: Mesh, name: str):
    """This rank's block of a stored tensor (safetensors ``get_slice`` handle ``sl``, stored
    shape ``shape``) laid out by ``sharding`` over a 2d/3d mesh: only the block is read, the
    part past the stored tensor (a padded vocabulary) is zeros. ``sharding`` None: the whole
    tensor (replicated)."""
    if sharding is None:
        return sl[:]
    if tuple(shape) != tuple(sharding.full_shape):
        raise UserError(
            f"{name}: checkpoint tensor has shape {tuple(shape)}, the model's parameter "
            f"{tuple(sharding.full_shape)} (a checkpoint of another model or config?)"
        )
    ranges = block_ranges(sharding, mesh)
    real = [(min(a, n), min(b, n)) for (a, b), n in zip(ranges, shape)]
    if any(b <= a for a, b in real):  # only padding (the caller casts to the parameter dtype)
        return torch.zeros([b - a for a, b in ranges])
    t = sl[tuple(slice(a, b) for a, b in real)]
    for d, ((a, b), (ra, rb)) in enumerate(zip(ranges, real)):
        if b - a > rb - ra:  # past the end of the stored tensor: zero padding
            pad = list(t.shape)
            pad[d] = (b - a) - (rb - ra)
            t = torch.cat([t, t.new_zeros(pad)], d)
    return t


def from_pretrained(
    path: str,
    mesh: Mesh | None = None,
    auto_class=None,
    sequence_parallel: bool = False,
    parallel_loss: bool = False,
    torch_dtype: torch.dtype | None = None,
    plan: dict[str, str] | None = None,
    wrap=None,
    **config_kwargs,
) -> nn.Module:
    """Build ``auto_class`` from the config at ``path`` on the meta device, shard it, and read
    only this rank's slices of each tensor from the safetensors files (never the full model).

    1d mesh: each parameter's HF slice map (:mod:`neuron_tp.hf.slice_map`); 2d/3d mesh: the
    block its sharding record gives this rank (:func:`block_ranges`), zero-padded past a
    vocabulary the split does not divide; replicated parameters are read whole. ``wrap``:
    applied to the meta-device model before it is sharded (e.g. LoRA adapters, which must
    come out of it with real weights: only meta parameters are read from the files)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..parallel.agreement import check_agreement

    auto_class = auto_class or AutoModelForCausalLM
    mesh = get_mesh(mesh)
    error, files, found = None, {}, {}
    try:  # a failure on one rank (a truncated file on one node) must stop every tp rank
        check_model_dir(path)
        config = AutoConfig.from_pretrained(path, **config_kwargs)
        files = checkpoint_files(path)
        found = files_fingerprint(files.values())
        kwargs = {"dtype": torch_dtype} if torch_dtype is not None else {}
        with params_on_meta():
            model = auto_class.from_config(config, **kwargs)
        if wrap is not None:
            model = wrap(model)
    except Exception as e:  # noqa: BLE001 - re-raised on this rank by check_agreement
        error = e
    check_agreement(
        {"model files (size, header + sampled data checksum)": found},
        mesh.tp,
        error=error,
        details={"model files (size, header + sampled data checksum)": found},
        what=f"from_pretrained({path!r})",
    )
    model = parallelize(
        model, mesh, sequence_parallel=sequence_parallel, parallel_loss=parallel_loss, plan=plan
    )
    handles: dict[str, object] = {}
    opened = _Opened(files, handles)
    try:
        for mname, mod in model.named_modules():
            for pname, p in list(mod.named_parameters(recurse=False)):
                name = plain_name(f"{mname}.{pname}" if mname else pname)
                if p.device.type != "meta":
                    continue
                name = stored_name(name, files)
                experts = _experts_range(mod, pname, mesh)  # expert parallelism: this rank's
                if name not in files and mesh.tp_mode == "1d":
                    local = read_per_expert(
                        name, files, opened.read, opened.shape, get_slice_map(mod, pname), experts
                    )
                    if local is not None:
                        _install(model, p, local)
                        continue
                if name not in files:
                    raise UserError(f"{path}: checkpoint has no tensor {name!r}")
                sl, shape = opened.handle(name), opened.shape(name)

                def read(dim, start, stop, name=name, experts=experts):
                    return opened.read(name, dim, start, stop, experts)

                if mesh.tp_mode == "1d":
                    local = read_local(read, shape, get_slice_map(mod, pname))
                else:
                    local = read_block(sl, shape, get_param_meta(mod, pname).sharding, mesh, name)
                _install(model, p, local, name)
        _load_buffers(model, files, opened)
    finally:
        handles.clear()
    model.eval()
    return model


def _experts_range(mod: nn.Module, name: str, mesh: Mesh) -> tuple[int, int] | None:
    """The experts (a range of dim 0) parameter ``name`` of ``mod`` holds on this rank under
    expert parallelism; None when it is not split over ``ep``."""
    sharding = get_param_meta(mod, name).sharding
    if expert_split(sharding) is None:
        return None
    g = mesh.group("ep")
    chunk = sharding.full_shape[0] // g.size
    return g.rank * chunk, (g.rank + 1) * chunk


class _Opened:
    """The checkpoint's tensors by name, each file opened once (``handles``: file -> handle)."""

    def __init__(self, files: dict[str, str], handles: dict):
        self.files, self.handles = files, handles

    def handle(self, name: str):
        """The safetensors slice handle of tensor ``name``."""
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = _open_safetensors(file)
        return self.handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handle(name).get_shape())

    def read(
        self,
        name: str,
        dim: int | None,
        start: int,
        stop: int,
        rows: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Tensor ``name`` (``dim`` None) or its ``[start, stop)`` range along ``dim``; only
        the ``rows`` range of dim 0 when given (a rank's experts)."""
        sl = self.handle(name)
        if dim is None and rows is None:
            return sl[:]
        ranges = {d: slice(None) for d in range(len(sl.get_shape()))}
        if rows is not None:
            ranges[0] = slice(*rows)
        if dim is not None:
            ranges[dim] = slice(start, stop)
        return sl[tuple(ranges[d] for d in sorted(ranges))]


def _install(model: nn.Module, p: nn.Parameter, local: torch.Tensor, name: str = "") -> None:
    """Replace meta parameter ``p`` (in every module holding it: tied ones) by ``local``."""
    local = local.to(p.dtype)
    if local.shape != p.shape:
        raise ValueError(
            f"{name}: checkpoint slice {tuple(local.shape)} does not "
            f"match this rank's parameter {tuple(p.shape)}"
        )
    new = nn.Parameter(local.contiguous(), requires_grad=p.requires_grad)
    for m2 in model.modules():
        for n2, p2 in list(m2._parameters.items()):
            if p2 is p:
                m2._parameters[n2] = new


def _load_buffers(model: nn.Module, files: dict[str, str], opened: _Opened) -> None:
    """Persistent buffers stored in the checkpoint (whole; replicated), in place; the others
    keep their initial values (as transformers does with a missing buffer)."""
    for name, b in persistent_buffers(model):
        name = stored_name(plain_name(name), files)
        if name in files:
            stored = opened.read(name, None, 0, 0)
            if tuple(stored.shape) != tuple(b.shape):
                raise UserError(
                    f"{name}: checkpoint buffer {tuple(stored.shape)} != model's {tuple(b.shape)}"
                )
            with torch.no_grad():
                b.copy_(stored.to(b.dtype))

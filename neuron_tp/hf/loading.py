"""Load only this rank's slices of a safetensors checkpoint into a model built on the meta
device and sharded."""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from ..errors import UserError
from ..parallel.mesh import Mesh, get_mesh
from ..parallel.sharding import (
    Sharding,
    expert_split,
    get_param_meta,
    shard_of,
)
from .lora_files import plain_name
from .model_files import OpenedFiles, check_model_dir, checkpoint_files, files_fingerprint
from .moe_files import read_per_expert, stored_name
from .parallelize import parallelize
from .quantized_files import SCALE, load_int8_layer, read_format
from .saving import persistent_buffers
from .slice_map import get_slice_map, read_local

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
    *,
    auto_class=None,
    sequence_parallel: bool = False,
    parallel_loss: bool = False,
    torch_dtype: torch.dtype | None = None,
    plan: dict[str, str] | None = None,
    wrap=None,
    cut=None,
    **config_kwargs,
) -> nn.Module:
    """Build ``auto_class`` from the config at ``path`` on the meta device, shard it, and read
    only this rank's slices of each tensor from the safetensors files (never the full model).

    1d mesh: each parameter's HF slice map (:mod:`neuron_tp.hf.slice_map`); 2d/3d mesh: the
    block its sharding record gives this rank (:func:`block_ranges`), zero-padded past a
    vocabulary the split does not divide; replicated parameters are read whole. ``wrap``:
    applied to the meta-device model before it is sharded (e.g. LoRA adapters, which must
    come out of it with real weights: only meta parameters are read from the files). ``cut``:
    applied to the sharded model while its parameters are still on the meta device (e.g. to
    keep one pipeline stage's layers): only the parameters it leaves are read and exist."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..parallel.agreement import check_agreement

    auto_class = auto_class or AutoModelForCausalLM
    mesh = get_mesh(mesh)
    error, files, found, int8 = None, {}, {}, None
    try:  # a failure on one rank (a truncated file on one node) must stop every tp rank
        check_model_dir(path)
        config = AutoConfig.from_pretrained(path, **config_kwargs)
        int8 = read_format(config, path)
        if int8 is not None:
            check_int8_load(path, mesh, wrap)
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
    tied = _tied_names(model)  # before the cut, which may drop the tensor's stored holder
    if cut is not None:
        cut(model)
    handles: dict[str, object] = {}
    opened = OpenedFiles(files, handles)
    try:
        int8_names = set()
        for mname, mod in model.named_modules():
            for pname, p in list(mod.named_parameters(recurse=False)):
                if p.device.type != "meta":
                    continue
                name = _stored(plain_name(f"{mname}.{pname}" if mname else pname), files, tied)
                if int8 and pname == "weight" and name[: -len("weight")] + SCALE in files:
                    _check_untied(model, mod, p, name)
                    load_int8_layer(mod, name, opened, p.dtype)
                    int8_names.add(name[: -len("weight")] + SCALE)
                    continue
                _load_parameter(model, mod, pname, p, name, opened=opened, mesh=mesh, path=path)
        _load_buffers(model, files, opened)
    finally:
        handles.clear()
    unused = sorted(n for n in files if n.endswith("." + SCALE) and n not in int8_names)
    if unused:
        raise UserError(
            f"{path}: int8 scales {', '.join(unused[:4])} match no parallel linear of the "
            f"sharded {type(model).__name__} (int8 checkpoints load with the 1D layers)"
        )
    model.eval()
    return model


def _load_parameter(model, mod, pname: str, p, name: str, *, opened: OpenedFiles, mesh, path):
    """Read this rank's slice of stored tensor ``name`` into meta parameter ``mod.<pname>``."""
    files = opened.files
    experts = _experts_range(mod, pname, mesh)  # expert parallelism: this rank's
    if name not in files and mesh.tp_mode == "1d":
        local = read_per_expert(
            name, files, opened.read, opened.shape, get_slice_map(mod, pname), experts
        )
        if local is not None:
            _install(model, p, local)
            return
    if name not in files:
        raise UserError(f"{path}: checkpoint has no tensor {name!r}")
    sl, shape = opened.handle(name), opened.shape(name)

    def read(dim, start, stop):
        return opened.read(name, dim, start, stop, experts)

    if mesh.tp_mode == "1d":
        local = read_local(read, shape, get_slice_map(mod, pname))
    else:
        local = read_block(sl, shape, get_param_meta(mod, pname).sharding, mesh, name)
    if local.dtype == torch.int8 and p.is_floating_point():
        raise UserError(
            f"{path}: {name} is stored as int8 without its {SCALE} (a quantized checkpoint "
            "of another layout, or a file missing from it)"
        )
    _install(model, p, local, name)


def check_int8_load(path: str, mesh: Mesh, wrap) -> None:
    """UserError unless the int8 directory ``path`` can load here: the 1D layers, no adapter
    wrapped before sharding (LoRA merges into float weights)."""
    if mesh.tp_mode != "1d":
        raise UserError(
            f"{path}: an int8 checkpoint loads with the 1D layers (tp_mode '1d'), not "
            f"tp_mode {mesh.tp_mode!r}: the 2D/3D layers have no int8 weights"
        )
    if wrap is not None:
        raise UserError(
            f"{path}: an int8 checkpoint cannot take an adapter (LoRA merges into float "
            "weights): merge the adapter into the float model, then quantize and save it"
        )


def _check_untied(model: nn.Module, owner: nn.Module, p: nn.Parameter, name: str) -> None:
    """UserError when int8 weight ``name`` is a parameter tied to another module's."""
    tied = [
        n
        for n, m in model.named_modules()
        if m is not owner and any(q is p for q in m._parameters.values())
    ]
    if tied:
        raise UserError(
            f"{name}: stored as int8 but tied to {', '.join(tied)}'s parameter in this "
            "model (tied weights stay in float): a checkpoint of another config?"
        )


def _tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Every name of a parameter held under several (tied embeddings): its other names."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(plain_name(n))
    return {n: [o for o in ns if o != n] for ns in names.values() if len(ns) > 1 for n in ns}


def _stored(name: str, files: dict[str, str], tied: dict[str, list[str]]) -> str:
    """The checkpoint's name of parameter ``name``: its own, or a tied alias's (the LM head
    of a pipeline's last stage, which no longer holds the embedding the file stores it as)."""
    own = stored_name(name, files)
    if own in files:
        return own
    found = [stored_name(a, files) for a in tied.get(name, ())]
    return next((a for a in found if a in files), own)


def _experts_range(mod: nn.Module, name: str, mesh: Mesh) -> tuple[int, int] | None:
    """The experts (a range of dim 0) parameter ``name`` of ``mod`` holds on this rank under
    expert parallelism; None when it is not split over ``ep``."""
    sharding = get_param_meta(mod, name).sharding
    if sharding is None or expert_split(sharding) is None:
        return None
    g = mesh.group("ep")
    chunk = sharding.full_shape[0] // g.size
    return g.rank * chunk, (g.rank + 1) * chunk


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


def _load_buffers(model: nn.Module, files: dict[str, str], opened: OpenedFiles) -> None:
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

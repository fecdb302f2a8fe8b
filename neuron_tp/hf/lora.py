"""LoRA adapters (the ``peft`` library) on tensor-parallel models.

Wrap first, then parallelize: ``parallelize(get_peft_model(model, LoraConfig(...)), mesh)``.
Each wrapped projection keeps its peft wrapper (and peft's module / parameter names); its
``base_layer`` becomes the parallel layer and the LoRA weights are sharded to match:

* column-parallel base (rows sharded, possibly a row selection: packed q/k/v, replicated kv
  heads): ``lora_A`` replicated, ``lora_B`` = the same rows of the full ``lora_B`` as the base
  weight. The LoRA branch reads the projection's input as the base does. Behind the shared
  input region (q/k/v, gate/up: the input is already region-copied, or sequence-gathered),
  ``h = A x`` with ``A``'s gradient all-reduced over tp (each rank's ``dh`` is partial); a
  projection with its own input region puts ``h`` through the copy region instead.
* row-parallel base (input features sharded): ``lora_A`` = this rank's input columns,
  ``lora_B`` replicated (gradient all-reduced); ``B A x_local * scaling`` is added to the base's
  partial product before its one reduction (all-reduce, or reduce-scatter under SP).

Replicated LoRA parameters get complete, identical gradients in backward (no extra sync
call). ``peft`` is imported lazily: the package imports with torch alone.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..layers import RowParallelLinear
from ..layers.common import WRAP_FIRST, mark_lora_base
from ..parallel import gathered_linears, regions
from ..parallel.agreement import check_agreement, tensor_checksum
from ..parallel.mesh import Mesh, get_mesh
from ..parallel.sharding import Sharding, gather_full, get_param_meta, mark_sharded
from ..parallel.state import attach, is_parallel, mesh_of, state_of
from .dropout import replicated_input, split_features_dropout
from .lora_files import SAFETENSORS, write_adapter_dir
from .lora_slices import column_lora_rows, row_lora_columns
from .lora_targets import check_targets, refuse_target_parameters
from .modules import HFColumnLinear
from .slice_map import HFSliceMap, even_pieces, get_slice_map, read_local, set_slice_map, to_hf


def is_peft_model(model: nn.Module) -> bool:
    """True for a ``peft.PeftModel`` (checked without importing peft)."""
    return type(model).__module__.startswith("peft.") and hasattr(model, "peft_config")


def refuse_parallelized(model: nn.Module) -> None:
    """UserError for a model already sharded that is about to be wrapped by peft (neuron_tp's
    own ``get_peft_model`` calls; peft's own call is refused by the parallel layers)."""
    if is_parallel(model):
        raise UserError(f"{type(model).__name__} is already parallelized; {WRAP_FIRST}")


def refuse_peft_layers(model: nn.Module) -> None:
    """ValueError when a plain model holds peft tuner layers (its PeftModel must be passed)."""
    for name, mod in model.named_modules():
        if type(mod).__module__.startswith("peft.tuners"):
            raise ValueError(
                f"{name}: a peft {type(mod).__name__} inside {type(model).__name__}; "
                "parallelize the PeftModel returned by get_peft_model (wrap first, then "
                "parallelize), not its inner model"
            )


def _adapter(model: nn.Module) -> str:
    """The one LoRA adapter of ``model``; ValueError for anything else peft can hold."""
    from peft import PeftType

    cfgs = model.peft_config
    if len(cfgs) != 1 or len(model.active_adapters) != 1:
        raise ValueError(
            f"{type(model).__name__}: adapters {list(cfgs)} (active {model.active_adapters}); "
            "tensor parallelism supports exactly one LoRA adapter"
        )
    (name, cfg), (active,) = next(iter(cfgs.items())), model.active_adapters
    if cfg.peft_type != PeftType.LORA or active != name:
        raise ValueError(
            f"{type(model).__name__}: peft method {cfg.peft_type}; tensor parallelism "
            "supports LoRA (LoraConfig) only"
        )
    unsupported = {
        "use_dora": cfg.use_dora,
        "lora_bias": cfg.lora_bias,
        "modules_to_save": cfg.modules_to_save,
        "trainable_token_indices": cfg.trainable_token_indices,
        "layer_replication": cfg.layer_replication,
        "use_qalora": getattr(cfg, "use_qalora", False),
        "alora_invocation_tokens": getattr(cfg, "alora_invocation_tokens", None),
        "arrow_config": getattr(cfg, "arrow_config", None),
    }
    bad = {k: v for k, v in unsupported.items() if v}
    if bad:
        raise ValueError(
            f"LoraConfig {bad}: not supported under tensor parallelism (supported: plain LoRA "
            "on linear / Conv1D projections, lora_dropout, rslora)"
        )
    return name


def _wrappers(inner: nn.Module) -> dict[str, nn.Module]:
    """``{name: peft tuner layer}`` in the inner model, each a plain ``lora.Linear``."""
    from peft.tuners.lora import Linear
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = {n: m for n, m in inner.named_modules() if isinstance(m, BaseTunerLayer)}
    for name, mod in found.items():
        if type(mod) is not Linear:
            base = type(mod.get_base_layer()).__name__
            raise ValueError(
                f"{name}: LoRA on a {type(mod).__name__} (base {base}); tensor parallelism "
                "supports LoRA on linear / Conv1D projections only (not embeddings, "
                "convolutions or quantized layers)"
            )
        if mod.merged:
            raise ValueError(f"{name}: adapter merged into the base weight; unmerge it first")
        if mod.lora_variant:
            raise ValueError(f"{name}: LoRA variant {list(mod.lora_variant)} not supported")
    return found


def _swap(inner: nn.Module, modules: dict[str, nn.Module]) -> None:
    for name, mod in modules.items():
        parent, _, attr = name.rpartition(".")
        setattr(inner.get_submodule(parent), attr, mod)


def parallelize_peft(model: nn.Module, mesh: Mesh | None, parallelize_fn, **options) -> nn.Module:
    """``parallelize`` for a ``PeftModel`` (called by :func:`neuron_tp.hf.parallelize`): the
    LoRA wrappers are taken out, the inner model is parallelized, and they are put back around
    the parallel layers with their weights sharded. ValueError (model unchanged) for what is
    not supported."""
    mesh = get_mesh(mesh)
    if mesh.tp_mode != "1d":
        raise ValueError(f"LoRA under tensor parallelism supports 1d meshes, not {mesh.tp_mode!r}")
    inner = model.base_model.model
    if is_parallel(inner):
        raise ValueError(
            f"{type(inner).__name__} inside the PeftModel is already parallelized; call "
            "get_peft_model on the unsharded model, then parallelize the PeftModel"
        )
    refuse_target_parameters(model, options.get("plan"))
    adapter = _adapter(model)
    wrappers = _wrappers(inner)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    _swap(inner, {n: w.base_layer for n, w in wrappers.items()})
    try:
        check_targets(inner, wrappers, options.get("plan"))  # before any collective
        check_agreement(
            {"LoRA weights (checksums)": {n: tensor_checksum(p) for n, p in lora.items()}},
            mesh.tp,
            what=f"parallelize({type(model).__name__})",
        )
        parallelize_fn(inner, mesh, **options)
    except BaseException:
        _swap(inner, wrappers)
        raise
    cls = _tp_lora_class()
    for name, w in wrappers.items():
        _shard_wrapper(w, inner.get_submodule(name), adapter, mesh)
        w.__class__ = cls
    _swap(inner, wrappers)
    record = lora_record(model, {n: w.scaling[adapter] for n, w in wrappers.items()})
    attach(model, state_of(inner).with_lora(record))
    return model


def lora_record(model: nn.Module, scaling: dict[str, float]) -> dict:
    """What a checkpoint of a parallelized PeftModel records to be merged or turned into an
    adapter directory offline (:mod:`neuron_tp.hf.lora_files`): the adapter name, its
    ``LoraConfig`` (JSON), peft's ``scaling`` per adapted module (``scaling``, module names of
    the plain model) and each LoRA parameter's key in peft's adapter file."""
    adapter = model.active_adapters[0]
    params = _adapter_params(model)
    config = model.peft_config[adapter].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    return {
        "adapter": adapter,
        "config": json.loads(json.dumps(config, default=str)),
        "scaling": {n: float(s) for n, s in scaling.items()},
        "keys": _peft_keys(model, [n for n, _ in params], adapter),
    }


def materialize_adapters(model: nn.Module) -> None:
    """Give a (meta-device) PeftModel's LoRA weights zeros on the CPU, the same on every rank:
    for a model whose adapters are loaded afterwards (a checkpoint, an adapter directory)."""
    from peft.tuners.lora import LoraLayer

    for mod in model.modules():
        if isinstance(mod, LoraLayer):
            for name in mod.active_adapters:
                for part in (mod.lora_A[name], mod.lora_B[name]):
                    w = part.weight  # set in _parameters: not through register_parameter,
                    part._parameters["weight"] = nn.Parameter(  # which a meta-init context
                        torch.zeros(w.shape, dtype=w.dtype),  # of another thread may patch
                        requires_grad=w.requires_grad,
                    )


def _full_reader(full: torch.Tensor):
    return lambda dim, a, b: full if dim is None else full.narrow(dim, a, b - a)


def _set_param(mod: nn.Module, name: str, value: torch.Tensor, like: nn.Parameter) -> None:
    setattr(mod, name, nn.Parameter(value.contiguous().clone(), requires_grad=like.requires_grad))


def _shard_wrapper(w: nn.Module, base: nn.Module, adapter: str, mesh: Mesh) -> None:
    """Put the parallel ``base`` in ``w`` and shard its LoRA weights to match."""
    a_mod, b_mod = w.lora_A[adapter], w.lora_B[adapter]
    a_full, b_full = a_mod.weight.detach(), b_mod.weight.detach()
    r = a_full.shape[0]
    if isinstance(base, HFColumnLinear):
        sm, sh = get_slice_map(base, "weight"), get_param_meta(base, "weight").sharding
        local = column_lora_rows(base, b_full)
        _set_param(b_mod, "weight", local, b_mod.weight)
        mark_sharded(b_mod, "weight", Sharding(sh.splits, (sh.full_shape[0], r), sh.segments))
        set_slice_map(b_mod, "weight", HFSliceMap(0, sm.pieces, False, sm.keep_rows))
        b_mod.out_features = local.shape[0]
        if base.replicas is not None:  # kv-head rows held by several ranks
            b_mod.__class__ = ReplicatedRowsLinear
            b_mod.register_buffer("_distinct_w", base._distinct_w.clone(), persistent=False)
    else:
        local = row_lora_columns(base, a_full)
        _set_param(a_mod, "weight", local, a_mod.weight)
        mark_sharded(a_mod, "weight", Sharding((("tp", 1),), tuple(a_full.shape)))
        set_slice_map(
            a_mod, "weight", HFSliceMap(1, tuple(even_pieces(a_full.shape[1], *_rank_tp(mesh))))
        )
        a_mod.in_features = local.shape[1]
    mark_lora_base(base)  # peft's layer code may ask it for a plan: it has none
    w.base_layer = base
    w.fan_in_fan_out = False  # the parallel base weight is [out, in] (GPT-2 Conv1D too)


def _rank_tp(mesh: Mesh) -> tuple[int, int]:
    return mesh.tp_rank, mesh.tp_size


class ReplicatedRowsLinear(nn.Linear):
    """A column ``lora_B`` some of whose rows are kv heads held by several tp ranks: tells
    :func:`neuron_tp.global_grad_norm` to count each distinct row once."""

    def distinct_row_weights(self, name: str) -> torch.Tensor | None:
        return self._distinct_w if name == "weight" else None


def _column_lora(w: nn.Module, x: torch.Tensor, adapter: str) -> torch.Tensor:
    """``B_local A dropout(x) * scaling`` for a column-parallel base (local output features);
    ``x`` is replicated, so its dropout is plain dropout."""
    base: HFColumnLinear = w.base_layer
    tp = base.mesh.tp
    a, lora_drop = w.lora_A[adapter].weight, w.lora_dropout[adapter]

    def drop(t: torch.Tensor) -> torch.Tensor:
        with replicated_input():
            return lora_drop(t)

    b = base._sync(w.lora_B[adapter].weight, x.device)  # kv-replica rows: grads summed
    if base.shared_region:
        # x is already region-copied / sequence-gathered: each rank's dh (so dA) is partial.
        a = regions.identity_fwd_all_reduce_bwd(a, tp)
        plain = isinstance(lora_drop, nn.Identity)
        h = gathered_linears.shared_gathered_linear(x, a) if plain else F.linear(drop(x), a)
    else:
        h = regions.identity_fwd_all_reduce_bwd(F.linear(drop(x), a), tp)
    return F.linear(h, b) * w.scaling[adapter]


def _row_lora(w: nn.Module, adapter: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The LoRA partial product of a row-parallel base, from its local input."""
    a, drop = w.lora_A[adapter].weight, w.lora_dropout[adapter]
    b = regions.identity_fwd_all_reduce_bwd(w.lora_B[adapter].weight, w.base_layer.mesh.tp)

    def partial(x_local: torch.Tensor) -> torch.Tensor:
        x_local = split_features_dropout(drop, x_local.to(a.dtype), w.base_layer.mesh.tp)
        return F.linear(F.linear(x_local, a), b) * w.scaling[adapter]

    return partial


def _tp_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's ``lora.Linear.forward`` over a parallel base layer (one adapter)."""
    if kwargs.get("adapter_names") is not None:
        raise ValueError("mixed-adapter batches (adapter_names) are not supported under tp")
    base = self.base_layer
    if self.disable_adapters and self.merged:
        self.unmerge()
    if self.disable_adapters or self.merged or not self.active_adapters:
        return base(x, *args, **kwargs)
    (adapter,) = self.active_adapters
    if isinstance(base, RowParallelLinear):
        return base(x, *args, partial_addend=_row_lora(self, adapter), **kwargs)
    y = base(x, *args, **kwargs)
    xa = x if x.dtype == self.lora_A[adapter].weight.dtype else x.to(self.lora_A[adapter].weight)
    return y + _column_lora(self, xa, adapter).to(y.dtype)


@functools.cache
def _tp_lora_class() -> type:
    """peft's ``lora.Linear`` with the tensor-parallel forward (peft's merge, state dict and
    adapter switching keep working: the class is a subclass)."""
    from peft.tuners.lora import Linear

    return type("TPLoraLinear", (Linear,), {"forward": _tp_forward, "__module__": __name__})


def _lora_wrappers(model: nn.Module) -> dict[str, nn.Module]:
    if not is_parallel(model) or not is_peft_model(model):
        raise ValueError(
            f"{type(model).__name__}: not a parallelized PeftModel; call "
            "neuron_tp.hf.parallelize(get_peft_model(model, LoraConfig(...)), mesh) first"
        )
    cls = _tp_lora_class()
    return {n: m for n, m in model.named_modules() if isinstance(m, cls)}


def _peft_keys(model: nn.Module, names: list[str], adapter: str) -> dict[str, str]:
    """``{parameter name: key in peft's adapter file}`` (peft's own renaming)."""
    from peft import get_peft_model_state_dict

    probe = {n: torch.tensor(float(i)) for i, n in enumerate(names)}
    keys = get_peft_model_state_dict(model, state_dict=probe, adapter_name=adapter)
    return {names[int(v)]: k for k, v in keys.items()}


def _adapter_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    wrappers = _lora_wrappers(model)
    return [
        (f"{name}.{pn}", p)
        for name, w in wrappers.items()
        for pn, p in w.named_parameters()
        if pn.startswith(("lora_A.", "lora_B."))
    ]


def gather_adapter(model: nn.Module, mesh: Mesh | None = None) -> dict[str, torch.Tensor]:
    """The full LoRA weights (CPU tensors) under the keys of peft's adapter file, on every
    rank (collective over tp): B row selections and A column shards joined, kv-replica copies
    dropped."""
    mesh = mesh_of(model, mesh)
    params = _adapter_params(model)
    keys = _peft_keys(model, [n for n, _ in params], model.active_adapters[0])
    out = {}
    for name, p in params:
        meta = get_param_meta(model, name)
        full = gather_full(p, meta.sharding, mesh)
        out[keys[name]] = to_hf(full, meta.hf_layout) if meta.sharding else full.clone()
    if any(t.device.type == "xla" for t in out.values()):
        from ..backend import xla as _xla

        _xla.xm().mark_step()  # one graph for every gather, on every rank alike
    return {k: v.cpu() for k, v in out.items()}


def save_adapter(model: nn.Module, out_dir: str, mesh: Mesh | None = None) -> None:
    """Write peft's adapter format (``adapter_model.safetensors`` + ``adapter_config.json``)
    from rank 0; collective over tp. Loads with ``PeftModel.from_pretrained(base, out_dir)``.
    Pipeline stages (``mesh.pp_size > 1``; collective over the world): each stage's first
    rank writes the adapters of its layers to ``out_dir`` (a directory every rank sees) and
    rank 0 joins them into the one file."""
    from safetensors.torch import load_file, save_file

    mesh = mesh_of(model, mesh)
    state = gather_adapter(model, mesh)
    config = model.peft_config[model.active_adapters[0]]
    if mesh.pp_size == 1:
        if mesh.rank == 0:
            write_adapter_dir(out_dir, config, state)
        return
    parts = [os.path.join(out_dir, f".stage-{s}.safetensors") for s in range(mesh.pp_size)]
    if mesh.tp_rank == 0 and mesh.dp_rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, parts[mesh.pp.rank])
    device = next(model.parameters()).device
    _world_barrier(mesh, device)
    if mesh.rank == 0:
        joined: dict[str, torch.Tensor] = {}
        for part in parts:
            joined.update(load_file(part))
            os.remove(part)
        write_adapter_dir(out_dir, config, joined)
    _world_barrier(mesh, device)


def _world_barrier(mesh: Mesh, device: torch.device) -> None:
    """Every rank of ``mesh`` got here (a one-element all-reduce, read on the host)."""
    from ..parallel import comm

    float(comm.all_reduce(torch.ones(1, device=device), mesh.group("world"))[0])


_SAME = ("r", "lora_alpha", "use_rslora", "fan_in_fan_out")


def load_adapter(model: nn.Module, adapter_dir: str, mesh: Mesh | None = None) -> None:
    """Load a peft adapter directory into a parallelized PeftModel (each rank keeps its
    shard). The adapter must have the model's LoRA settings (r, lora_alpha, rslora) and
    weights for every LoRA parameter; ValueError otherwise."""
    from safetensors.torch import load_file

    mesh = mesh_of(model, mesh)
    adapter = model.active_adapters[0]
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        saved = json.load(f)
    cfg = model.peft_config[adapter]
    diff = {k: (saved.get(k), getattr(cfg, k)) for k in _SAME if saved.get(k) != getattr(cfg, k)}
    if diff:
        raise ValueError(f"{adapter_dir}: adapter settings differ from the model's {diff}")
    state = load_file(os.path.join(adapter_dir, SAFETENSORS))
    params = _adapter_params(model)
    keys = _peft_keys(model, [n for n, _ in params], adapter)
    missing = [keys[n] for n, _ in params if keys[n] not in state]
    if missing:
        raise ValueError(f"{adapter_dir}: no weights for {missing[:3]} ({len(missing)} missing)")
    for name, p in params:
        full = state[keys[name]]
        sm = get_param_meta(model, name).hf_layout or HFSliceMap(None)
        local = read_local(_full_reader(full), tuple(full.shape), sm)
        if local.shape != p.shape:
            raise ValueError(
                f"{keys[name]}: adapter tensor {tuple(full.shape)} does not fit the model's "
                f"parameter (local {tuple(p.shape)}); an adapter of another model?"
            )
        with torch.no_grad():
            p.copy_(local.to(p.dtype))


def merge_adapters(model: nn.Module) -> nn.Module:
    """Merge the LoRA weights into the sharded base weights and unwrap them (peft's
    ``merge_and_unload``): returns the inner, still parallelized, transformers model."""
    wrappers = _lora_wrappers(model)
    inner = model.base_model.model
    for name, w in wrappers.items():
        (adapter,) = w.active_adapters
        base = w.base_layer
        a, b = w.lora_A[adapter].weight, w.lora_B[adapter].weight
        with torch.no_grad():
            delta = (b.float() @ a.float()) * w.scaling[adapter]
            base.weight.add_(delta.to(base.weight.dtype))
        _swap(inner, {name.removeprefix("base_model.model."): base})
    attach(inner, state_of(model).with_lora(None))
    return inner

"""Per-rank bytes of a training job's model state, predicted from the code that trains: the
transformers model is built on the meta device (no memory), sharded by
:func:`neuron_tp.hf.parallelize` for one rank of a virtual mesh, and every local parameter
shape is read off the result; the optimizer's share follows the rules of ``torch.optim.AdamW``
(two fp32 moments per trained element) and of :class:`neuron_tp.optim.zero1.Zero1` (each parameter
flattened, zero-padded to a multiple of dp and cut into dp chunks; fp32 masters for bf16
parameters)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq
MASTER_BYTES = 4  # fp32 master weights and moments


@dataclass(frozen=True)
class StateBytes:
    """One rank's bytes: parameters, gradients, optimizer moments, fp32 master weights."""

    params: int
    grads: int
    optimizer: int
    masters: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.masters


def local_parameters(config, tp: int, tp_mode: str = "1d", rank: int = 0, dtype=torch.float32):
    """The parameters (meta tensors, this rank's local shapes) of ``config``'s causal LM
    sharded for tensor-parallel rank ``rank`` of a ``tp``-way ``tp_mode`` mesh; tied
    parameters once."""
    from .trace import Spec, sharded_meta_model

    spec = Spec(tp=tp, tp_mode=tp_mode, bf16=dtype == torch.bfloat16)
    model, _ = sharded_meta_model(config, spec, rank)
    return list({id(p): p for p in model.parameters()}.values())


def state_bytes(
    config,
    tp: int,
    *,
    tp_mode: str = "1d",
    dp: int = 1,
    rank: int = 0,
    bf16: bool = False,
    zero1: bool = False,
) -> StateBytes:
    """Predicted bytes of model state on tensor-parallel rank ``rank`` of a ``tp`` x ``dp``
    training job (``neuron-tp train``'s optimizer: AdamW; ``--bf16`` implies ZeRO-1)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    params = local_parameters(config, tp, tp_mode, rank, dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    numel = [p.numel() for p in params if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    if not (zero1 or bf16):
        moments = ADAM_MOMENTS * MASTER_BYTES * sum(numel)
        return StateBytes(n_params * size, sum(numel) * size, moments, 0)
    chunks = sum(-(-n // dp) for n in numel)  # this dp rank's chunk of every parameter
    masters = chunks * MASTER_BYTES if bf16 else 0
    return StateBytes(
        n_params * size, sum(numel) * size, ADAM_MOMENTS * MASTER_BYTES * chunks, masters
    )


_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
_FIRST = ("embed", "wte", "wpe")  # input embeddings: the first stage's


def stage_of(name: str, layers: int, pp: int) -> tuple[int, ...]:
    """The pipeline stages holding parameter ``name`` of a ``layers``-deep model cut into
    ``pp`` stages of ``layers / pp`` consecutive decoder layers: a decoder layer's parameter
    its stage, an input embedding the first, everything else (final norm, LM head) the last."""
    m = _LAYER.search(name)
    if m:
        return (int(m[1]) // (layers // pp),)
    if any(key in name for key in _FIRST):
        return (0,)
    return (pp - 1,)


_PARTS: dict[tuple, list[tuple[str, int, bool, int]]] = {}  # see _named_parts


def _named_parts(config, tp: int, tp_mode: str, bf16: bool) -> list[tuple[str, int, bool, int]]:
    """(qualified name, local numel, trained, identity) of every parameter of ``config``'s
    model sharded for tp rank 0 (a tied parameter under each of its names); one meta build
    per model and tp layout in a process."""
    import json

    from .trace import Spec, sharded_meta_model

    key = (json.dumps(config.to_dict(), sort_keys=True, default=str), tp, tp_mode, bf16)
    if key not in _PARTS:
        model, _ = sharded_meta_model(config, Spec(tp=tp, tp_mode=tp_mode, bf16=bf16), 0)
        _PARTS[key] = [
            (f"{mod_name}.{pname}", p.numel(), p.requires_grad, id(p))
            for mod_name, mod in model.named_modules()
            for pname, p in mod.named_parameters(recurse=False)
        ]
    return _PARTS[key]


def stage_state_bytes(
    config,
    tp: int,
    tp_mode: str = "1d",
    replicas: int = 1,
    *,
    bf16: bool = False,
    zero1: bool = False,
    pp: int = 1,
) -> list[StateBytes]:
    """:func:`state_bytes` of each of ``pp`` pipeline stages (ZeRO-1 over the ``replicas``
    ranks holding the same stage: dp, or dp x cp). A parameter shared by the two ends (tied
    input and output embeddings) is one table on each end stage."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    layers = config.num_hidden_layers
    owned: list[dict[int, tuple[int, bool]]] = [{} for _ in range(pp)]
    for name, numel, trained, ident in _named_parts(config, tp, tp_mode, bf16):
        for stage in stage_of(name, layers, pp):
            owned[stage][ident] = (numel, trained)
    size = torch.tensor([], dtype=dtype).element_size()
    out = []
    for params in owned:
        sizes = [n for n, trained in params.values() if trained]
        total = sum(n for n, _ in params.values())
        if not (zero1 or bf16):
            moments = ADAM_MOMENTS * MASTER_BYTES * sum(sizes)
            out.append(StateBytes(total * size, sum(sizes) * size, moments, 0))
            continue
        chunks = sum(-(-n // replicas) for n in sizes)
        masters = chunks * MASTER_BYTES if bf16 else 0
        out.append(
            StateBytes(
                total * size, sum(sizes) * size, ADAM_MOMENTS * MASTER_BYTES * chunks, masters
            )
        )
    return out

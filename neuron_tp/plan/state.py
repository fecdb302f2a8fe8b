"""Per-rank bytes of a training job's model state, predicted from the code that trains: the
transformers model is built on the meta device (no memory), sharded by
:func:`neuron_tp.hf.parallelize` for one rank of a virtual mesh, and every local parameter
shape is read off the result; the optimizer's share follows the rules of ``torch.optim.AdamW``
(two fp32 moments per trained element) and of :class:`neuron_tp.optim.zero1.Zero1` (each parameter
flattened, zero-padded to a multiple of dp and cut into dp chunks; fp32 masters for bf16
parameters)."""

from __future__ import annotations

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

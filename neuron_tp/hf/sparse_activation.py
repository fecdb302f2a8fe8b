"""Activation sparsity over sharded MLP features (Gemma-3n's gaussian top-k: the gate's
features below mean + z * std of the token's features are cut), and the residual streams
that sequence parallelism cannot shard (Gemma-3n's AltUp stack)."""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import regions
from ..parallel.mesh import Group

# The method of an MLP module that cuts its gate's features by their statistics.
TOPK = "_gaussian_topk"


class ShardedGaussianTopK:
    """An MLP's ``_gaussian_topk`` on this rank's gate features: the mean and the (biased)
    standard deviation over all ``features`` of the token, from sums all-reduced over tp
    (forward and backward: every rank uses the sums on its own features)."""

    def __init__(self, sparsity: float, tp: Group, features: int):
        self.sparsity, self.tp, self.features = sparsity, tp, features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        target = torch.tensor(self.sparsity, dtype=torch.float32, device=x.device)
        z = torch.distributions.normal.Normal(0, 1).icdf(target).type(x.dtype)
        total = regions.all_reduce_fwd_all_reduce_bwd(x.sum(-1, keepdim=True), self.tp)
        mean = total / self.features
        ssq = regions.all_reduce_fwd_all_reduce_bwd(
            (x - mean).pow(2).sum(-1, keepdim=True), self.tp
        )
        std = torch.sqrt(ssq / self.features)
        return nn.functional.relu(x - (mean + std * z))


def install_sharded_topk(model: nn.Module, tp: Group) -> None:
    """Give every MLP with a sparse gate (``activation_sparsity`` > 0) whose ``gate_proj``
    is split over tp the statistics over all its features."""
    if tp.size == 1:
        return
    for mod in model.modules():
        gate = getattr(mod, "gate_proj", None)
        if not callable(getattr(mod, TOPK, None)) or not getattr(mod, "activation_sparsity", 0):
            continue  # no sparse gate
        if gate is None or getattr(gate, "gather_output", True):
            continue  # not split (or gathered): the features are whole
        features = getattr(mod, "intermediate_size", None)
        if not isinstance(features, int):
            features = gate.weight.shape[0] * tp.size
        sparsity = float(vars(mod)["activation_sparsity"])
        setattr(mod, TOPK, ShardedGaussianTopK(sparsity, tp, features))


def refuse_stacked_residual(model: nn.Module, layers: nn.ModuleList) -> None:
    """ValueError for decoder layers that carry a stack of residual streams (Gemma-3n's
    AltUp: ``[k, batch, seq, hidden]``), whose sequence is not the dim sequence parallelism
    shards."""
    for i, layer in enumerate(layers):
        if any(type(m).__name__.endswith("AltUp") for m in layer.children()):
            raise ValueError(
                f"{type(model).__name__}: decoder layer {i} ({type(layer).__name__}) takes a "
                "stack of residual streams (AltUp, [k, batch, seq, hidden]), which sequence "
                "parallelism does not shard; use sequence_parallel=False for this model"
            )

"""Counting the activation bytes autograd saves for backward (the memory tests' probe)."""

import torch
from torch import nn


class SavedBytes:
    """Saved-for-backward activation bytes, one count per storage (views and re-saves counted
    once). The parameters of ``module`` are left out: they are not activations (and on CPU a
    shard initialised by slicing the full weight may still view the full storage)."""

    def __init__(self, module: nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.seen: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in self.params:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())

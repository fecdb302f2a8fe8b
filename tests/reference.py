"""Helpers for comparing sharded layers with the unsharded computation."""
from __future__ import annotations

import torch

import neuron_tp as ntp
from neuron_tp.sharding import get_sharding


def full_param_and_grad(p: torch.nn.Parameter, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered parameter and its gathered gradient (laid out like the parameter)."""
    return ntp.gather_full(p, mesh), ntp.gather_full(p.grad, mesh, get_sharding(p))




def assert_close(actual, expected, what: str, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")

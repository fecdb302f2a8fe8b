"""Helpers for comparing sharded layers with the unsharded computation."""

from __future__ import annotations

import torch

import neuron_tp as ntp


def full_param_and_grad(
    module: torch.nn.Module, name: str, mesh
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered parameter ``name`` of ``module`` and its gathered gradient."""
    sh = ntp.get_sharding(module, name)
    p = module.get_parameter(name)
    return ntp.gather_full(p, sh, mesh), ntp.gather_full(p.grad, sh, mesh)


def assert_close(actual, expected, what: str, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")

"""The independent reference of the int8-weights tests, in plain torch and fp32."""

from __future__ import annotations

import copy

import torch


def dq_reference(w: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(w)): one symmetric scale per output row, absmax / 127, round,
    clamp to +-127."""
    w = w.detach().float()
    s = w.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(w / s).clamp(-127, 127) * s


def reference_model(full: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``full`` whose nn.Linear weights, all but the LM head's, are dequantized int8."""
    ref = copy.deepcopy(full)
    with torch.no_grad():
        for name, mod in ref.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                mod.weight.copy_(dq_reference(mod.weight))
    return ref

"""The optimizer of ``neuron-tp train`` and its learning-rate schedule: AdamW (matrices decay,
vectors do not) and linear warmup + cosine decay, both shaped so every step traces the same
graph (the learning rate and AdamW's step count are device data, not graph constants)."""

from __future__ import annotations

import math

import torch

from ..backend.xla import set_in_place


class WarmupCosine:
    """Linear warmup to ``lr`` over ``warmup`` steps, cosine decay to ``min_lr`` at ``total``.

    The learning rate is computed on the host from the step count (known without reading the
    device) and handed to the optimizer as a device tensor, so it is graph *data*: the step
    graph is the same at every step."""

    def __init__(self, optimizer, lr: float, min_lr: float, warmup: int, total: int):
        self.optimizer, self.base, self.min_lr = optimizer, lr, min_lr
        self.warmup, self.total, self.step_count = warmup, total, 0

    def value(self, step: int) -> float:
        if step < self.warmup:
            return self.base * (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_lr + 0.5 * (self.base - self.min_lr) * (1 + math.cos(math.pi * progress))

    def apply(self) -> float:
        """Set the learning rate of the upcoming step; returns it."""
        lr = self.value(self.step_count)
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                set_in_place(group["lr"], lr)
            else:
                group["lr"] = lr
        return lr

    def step(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict:
        return {
            "step_count": self.step_count,
            "base": self.base,
            "min_lr": self.min_lr,
            "warmup": self.warmup,
            "total": self.total,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])


def _param_groups(
    model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device
) -> list[dict]:
    """Matrices decay, vectors (norms, biases) do not; on XLA the learning rate is a device
    tensor (graph data)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    if device.type == "xla":
        for g in groups:
            g["lr"] = torch.tensor([lr], dtype=torch.float32, device=device)
    return groups


def make_optimizer(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float,
    device: torch.device,
    zero1_mesh=None,
):
    """AdamW; on XLA with a tensor learning rate and ``capturable`` (the step count stays on
    the device: no host read, no step-dependent constant in the graph). Matrices decay,
    vectors (norms, biases) do not. With ``zero1_mesh`` the same AdamW as a
    :class:`neuron_tp.optim.zero1.Zero1` over that mesh's dp group (state sharded, fp32 masters)."""
    groups = _param_groups(model, lr, weight_decay, device)
    xla = device.type == "xla"
    if zero1_mesh is not None:
        from .zero1 import Zero1

        return Zero1(groups, zero1_mesh, lr=lr, model=model, capturable=xla, foreach=False)
    return torch.optim.AdamW(groups, lr=lr, capturable=xla, foreach=False)

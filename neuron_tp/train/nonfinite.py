"""Non-finite loss or gradient norm: detected on the device at every step, acted on by the
host at log steps and before every checkpoint.

Every step adds a few scalar ops to the step graph (the same graph at every step): whether
the dp-mean loss and the global gradient norm are finite (both are all-reduced, so every rank
decides alike without another collective), a count of non-finite steps and the first one.
Nothing extra is read from the device at ordinary steps: the counters travel with the loss and
grad norm the log closure reads anyway (no extra transfer), and are read once before a
checkpoint unless that step was just logged.

Default: the run stops with :class:`NonFiniteError` on every rank (at the next log step or
checkpoint, whichever comes first) and never saves. With ``skip=True`` (``--skip-nonfinite``)
a non-finite step's optimizer update is undone on the device (``torch.where`` over parameters
and optimizer states, no host read; it holds a copy of them during the step): parameters and
AdamW moments stay as before the step, the data and the learning-rate schedule move on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class NonFiniteError(RuntimeError):
    """The loss or gradient norm of a step was NaN or infinite."""


class NonFiniteGuard:
    """Counts non-finite steps on the device; see the module docstring."""

    def __init__(self, device: torch.device, skip: bool = False):
        self.skip = skip
        # [steps seen, non-finite steps, first non-finite step (1-based, 0 = none)]: uploaded
        # (device data, not a graph constant), then carried from step to step.
        self.state = torch.zeros(3).to(device)
        self.base = 0  # the global step the counting started after
        self.known = (0, 0, 0)  # host copy as of global step known[0]: (step, bad, first)

    def observe(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """Record this step's loss and grad norm; returns the device-side 0-d ``ok`` flag."""
        ok = torch.isfinite(loss).all() & torch.isfinite(norm).all()
        bad = (~ok).float()
        n = self.state[0] + 1
        first = torch.where((self.state[2] == 0) & ~ok, n, self.state[2])
        self.state = torch.stack([n, self.state[1] + bad, first])
        return ok

    def optimizer_step(self, optimizer: torch.optim.Optimizer, ok: torch.Tensor) -> None:
        """``optimizer.step()``; in skip mode undone on the device where ``ok`` is false."""
        if not self.skip:
            optimizer.step()
            return
        saved = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    old = {
                        k: v.clone()
                        for k, v in optimizer.state.get(p, {}).items()
                        if isinstance(v, torch.Tensor)
                    }
                    saved.append((p, p.detach().clone(), old))
        optimizer.step()
        with torch.no_grad():
            for p, old_p, old in saved:
                p.copy_(torch.where(ok, p, old_p))
                for k, v in optimizer.state[p].items():
                    if isinstance(v, torch.Tensor):  # state made by this step: AdamW's is zeros
                        prev = old[k] if k in old else torch.zeros_like(v)
                        v.copy_(torch.where(ok.to(v.device), v, prev))

    def pack(self, loss: torch.Tensor, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[loss, first bad step]`` and ``[norm, bad steps]`` for the log closure."""
        return torch.cat([loss, self.state[2:3]]), torch.cat([norm, self.state[1:2]])

    def note(self, step: int, loss_row, norm_row) -> None:
        """Host values read by the log closure at global ``step``."""
        if len(loss_row) > 1:
            self.known = (step, int(norm_row[1]), int(loss_row[1]))

    def sync(self, step: int) -> None:
        """Read the counters (one transfer) unless they are known as of ``step``."""
        if self.known[0] != step:
            vals = self.state.cpu()
            self.known = (step, int(vals[1]), int(vals[2]))

    @property
    def skipped(self) -> int:
        return self.known[1] if self.skip else 0

    def check(self, newest: Callable[[], str | None] = lambda: None) -> None:
        """Raise :class:`NonFiniteError` (stop mode) when a non-finite step is known."""
        step, bad, first = self.known
        if self.skip or not bad:
            return
        last = newest()
        where = f"the newest checkpoint is {last}" if last else "no checkpoint was saved"
        raise NonFiniteError(
            f"non-finite loss or gradient norm at step {self.base + first} ({bad} such "
            f"step(s) up to step {step}); stopped without saving ({where}). Lower --lr or "
            "--max-grad-norm, check the data, or pass --skip-nonfinite to skip such steps"
        )

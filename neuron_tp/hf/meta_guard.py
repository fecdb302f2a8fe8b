"""The guard of a model parallelized on the meta device (no weights yet): it refuses to run
until its weights are loaded."""

from __future__ import annotations

from torch import nn

from ..errors import UserError


def guard_meta(model: nn.Module) -> None:
    """A model parallelized on the meta device refuses to run until its weights are loaded
    (the hook removes itself at the first forward that finds none left on meta)."""
    if not any(p.is_meta for p in model.parameters()):
        return

    def check(module, args, kwargs):
        left = [n for n, p in module.named_parameters() if p.is_meta]
        if left:
            raise UserError(
                f"{type(module).__name__}: {len(left)} parameters (e.g. {left[0]}) are still on "
                "the meta device: the model was parallelized without weights. Load them first: "
                "neuron_tp.from_pretrained(path, mesh) reads each rank's slices of a HF "
                "checkpoint; or parallelize a model built with real weights"
            )
        handle.remove()

    handle = model.register_forward_pre_hook(check, with_kwargs=True)

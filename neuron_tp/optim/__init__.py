"""Gradients and optimizers of a sharded model: gradient reduction and clipping, AdamW
and its schedule, ZeRO-1 and its state layout."""

"""Tensor parallelism for HuggingFace transformers models: ``parallelize`` a model in place,
``from_pretrained`` only this rank's slices, ``save_pretrained`` a consolidated checkpoint.
Plans (which module is sharded how, where the layers are) live in :mod:`neuron_tp.hf.plans`;
2D / 3D meshes in :mod:`.parallelize_nd`. Also: LoRA on parallelized models (:mod:`.lora`),
MoE blocks (:mod:`.moe`), inputs of packed rows (:mod:`.packing`) and activation recompute
(:mod:`.recompute`)."""

from .loading import from_pretrained
from .parallel_loss import full_logits
from .parallelize import parallelize
from .plans import ARCH_PLANS
from .resolve import resolve_plan
from .saving import gather_hf_state_dict, save_pretrained
from .styles import STYLES, ArchPlan, Style

__all__ = [
    "parallelize",
    "from_pretrained",
    "save_pretrained",
    "gather_hf_state_dict",
    "full_logits",
    "resolve_plan",
    "Style",
    "STYLES",
    "ArchPlan",
    "ARCH_PLANS",
]

"""Tensor parallelism for HuggingFace transformers models: ``parallelize`` a model in place,
``from_pretrained`` only this rank's slices, ``save_pretrained`` a consolidated checkpoint."""
from .loading import from_pretrained, gather_hf_state_dict, save_pretrained
from .parallelize import full_logits, parallelize
from .plans import BUILTIN_BASE_PLANS, STYLES, resolve_plan

__all__ = ["parallelize", "from_pretrained", "save_pretrained", "gather_hf_state_dict",
           "full_logits", "resolve_plan", "STYLES", "BUILTIN_BASE_PLANS"]

"""Mixture-of-experts layers under tensor parallelism, with static shapes: routers
(:mod:`.routing`), tp-sharded fused experts (:mod:`.experts`), shared experts (:mod:`.shared`),
the MoE block with one reduction per layer (:mod:`.block`) and experts distributed over an ep
group with tokens exchanged by all-to-all (:mod:`.expert_parallel`). Pure torch; the
transformers glue is :mod:`neuron_tp.hf.moe`."""

from .block import ParallelMoEBlock, set_moe_mode
from .expert_parallel import ExpertParallelOutput, expert_capacity, expert_parallel_mlp
from .experts import MODES, TPExperts, pick_mode
from .interface import ExpertsLayout, TPInterfaceExperts
from .routing import ROUTER_KINDS, Router, sigmoid_group_topk, softmax_topk
from .shared import TPSharedMLP

__all__ = [
    "ExpertParallelOutput",
    "ExpertsLayout",
    "MODES",
    "ROUTER_KINDS",
    "ParallelMoEBlock",
    "Router",
    "TPExperts",
    "TPInterfaceExperts",
    "TPSharedMLP",
    "expert_capacity",
    "expert_parallel_mlp",
    "pick_mode",
    "set_moe_mode",
    "sigmoid_group_topk",
    "softmax_topk",
]

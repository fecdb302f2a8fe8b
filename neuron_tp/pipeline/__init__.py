"""Pipeline parallelism: the schedule as data (:mod:`.schedule`), the lockstep stage exchange
(:mod:`.exchange`), cutting a decoder model into stages (:mod:`.stages`) or a stack of the
layer library's blocks (:mod:`.block_stages`) and the step runner (:mod:`.runner`)."""

from .block_stages import BlockStack, BlockStage, stages_of_blocks
from .exchange import Exchange
from .runner import PipelineRunner
from .schedule import Schedule, Task, build
from .stages import PipelineStage, StagePlan, plan_stages, split_model, sum_tied_grads

__all__ = [
    "BlockStack",
    "BlockStage",
    "Exchange",
    "PipelineRunner",
    "PipelineStage",
    "Schedule",
    "StagePlan",
    "Task",
    "build",
    "plan_stages",
    "split_model",
    "stages_of_blocks",
    "sum_tied_grads",
]

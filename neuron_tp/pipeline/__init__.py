"""Pipeline parallelism: the schedule as data (:mod:`.schedule`), the lockstep stage exchange
(:mod:`.exchange`), cutting a decoder model into stages (:mod:`.stages`) and the step runner
(:mod:`.runner`)."""

from .exchange import Exchange
from .runner import PipelineRunner
from .schedule import Schedule, Task, build
from .stages import PipelineStage, StagePlan, plan_stages, split_model, sum_tied_grads

__all__ = [
    "Exchange",
    "PipelineRunner",
    "PipelineStage",
    "Schedule",
    "StagePlan",
    "Task",
    "build",
    "plan_stages",
    "split_model",
    "sum_tied_grads",
]

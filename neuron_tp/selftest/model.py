"""stub"""
from .context import Context
from .report import Check


def check_model(ctx: Context) -> Check:
    return Check("model", summary="todo")

"""stub"""
from .context import Context
from .report import Check


def check_compile(ctx: Context) -> Check:
    return Check("compile", summary="todo")

"""A job's parallel layout: every degree in one typed record, and the arithmetic that the
degrees alone decide (what divides the world, which tp a grid takes, where ep fits).

:class:`ParallelLayout` is built once from a command's options
(:meth:`ParallelLayout.of`); the :class:`~neuron_tp.parallel.mesh.Mesh` is made from it, and
the rules that also need the model and the batch shape
(:func:`neuron_tp.job.layout_rules.refusals`) start from :meth:`ParallelLayout.refusals`, so the
trainer, ``train --check`` and the planner read one set of rules.

World layout, outermost first: ``pp x dp x cp x tp`` (``ep`` blocks inside dp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UserError

TP_MODES = ("1d", "2d", "3d")
ATTENTIONS = ("sdpa", "blockwise")
PP_SCHEDULES = ("1f1b", "interleaved")


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def grid_side(tp: int, tp_mode: str) -> int:
    """``q``, the side of the 2D grid (``tp = q*q``) or 3D cube (``tp = q^3``) of ``tp`` ranks;
    1 for ``1d``. The one place this is computed (whether ``tp`` is such a power:
    :meth:`ParallelLayout.refusals`)."""
    if tp_mode == "2d":
        return math.isqrt(tp)
    return round(tp ** (1 / 3)) if tp_mode == "3d" else 1


def launch_hint(world_size: int, tp: int) -> str:
    """How to start a job whose world size tp divides."""
    if tp < 1:
        return ""
    return (
        f" (this job has {world_size} rank{'s' if world_size > 1 else ''}: start a multiple "
        f"of {tp} with `torchrun --nproc_per_node {tp} ...`, or on the CPU run all ranks in "
        f"this one process with `--device xla --xla-cpu-devices {tp}`)"
    )


@dataclass(frozen=True)
class ParallelLayout:
    """Every parallel degree of a job, and the attention kind its ring needs.

    ``world``: ranks of the job; ``tp`` with ``tp_mode`` (1d, 2d: tp = q*q, 3d: tp = q^3) and
    ``sequence_parallel`` (1d); ``pp`` stages with their ``pp_schedule`` and
    ``virtual_stages``; ``cp``: the context-parallel ring; ``ep``: expert parallelism inside
    dp; ``attention``: sdpa or blockwise. ``dp`` follows: world / (pp x cp x tp)."""

    world: int
    tp: int = 1
    tp_mode: str = "1d"
    sequence_parallel: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    cp: int = 1
    ep: int = 1
    attention: str = "sdpa"

    @classmethod
    def of(cls, config, world: int) -> ParallelLayout:
        """The layout a ``TrainConfig`` (or anything with its fields) asks for at ``world``."""
        pipe, context = config.pipeline, config.context
        return cls(
            world=world,
            tp=config.tp,
            tp_mode=config.tp_mode,
            sequence_parallel=config.sequence_parallel,
            pp=pipe.pp,
            pp_schedule=pipe.pp_schedule,
            virtual_stages=pipe.virtual_stages,
            cp=context.cp,
            ep=config.ep,
            attention=config.attention,
        )

    @property
    def dp(self) -> int:
        return max(1, self.world // max(1, self.pp * self.cp * self.tp))

    def refusals(self) -> list[str]:
        """Why the degrees alone cannot make a mesh of ``world`` ranks (empty: they can)."""
        out = self._tp_refusals()
        if out:
            return out
        out += self._outer_refusals()
        if out:
            return out
        dp, outer = self.dp, self.pp * self.cp
        if self.ep < 1 or dp % self.ep:
            others = f"tp {self.tp}" + (f" / pp x cp {outer}" if outer > 1 else "")
            out.append(
                f"ep={self.ep} does not divide the data-parallel degree {dp} (world "
                f"{self.world} / {others}); valid ep degrees: {divisors(dp)}"
            )
        return out

    def check(self) -> None:
        """UserError with the first of :meth:`refusals`."""
        why = self.refusals()
        if why:
            raise UserError(why[0])

    def _tp_refusals(self) -> list[str]:
        tp, world, mode = self.tp, self.world, self.tp_mode
        if mode not in TP_MODES:
            return [f"tp_mode must be one of {TP_MODES}, got {mode!r}"]
        if not isinstance(tp, int) or tp < 1 or world % tp:
            return [
                f"tp={tp} does not divide the world size {world}; valid tp degrees: "
                f"{divisors(world)}" + launch_hint(world, tp)
            ]
        if mode == "2d" and grid_side(tp, "2d") ** 2 != tp:
            valid = [d for d in divisors(world) if grid_side(d, "2d") ** 2 == d]
            return [f"tp_mode='2d' needs tp = q*q, got tp={tp}; valid: {valid}"]
        if mode == "3d" and grid_side(tp, "3d") ** 3 != tp:
            valid = [d for d in divisors(world) if grid_side(d, "3d") ** 3 == d]
            return [f"tp_mode='3d' needs tp = q*q*q, got tp={tp}; valid: {valid}"]
        return []

    def _outer_refusals(self) -> list[str]:
        """pp x cp x tp must divide the world (tp alone is checked first)."""
        for name, value in (("pp", self.pp), ("cp", self.cp)):
            if not isinstance(value, int) or value < 1:
                return [f"{name} must be a positive integer, got {value!r}"]
        if self.world % (self.pp * self.cp * self.tp):
            room = self.world // self.tp
            return [
                f"pp={self.pp} x cp={self.cp} x tp={self.tp} = {self.pp * self.cp * self.tp} "
                f"does not divide the world size {self.world}; with tp={self.tp}, pp x cp must "
                f"divide {room}: one of {divisors(room)}"
            ]
        return []

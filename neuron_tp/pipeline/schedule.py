"""Pipeline schedules as data: a list of lockstep ticks, each tick one task (or none) per stage.

In every tick each stage runs at most one task, the forward (``F``) or backward (``B``) of one
micro-batch on one of its model chunks; then every stage takes part in one exchange that moves
activations to the next stage and activation gradients to the previous one
(:mod:`neuron_tp.pipeline.exchange`). A task that needs a neighbour's output waits until the
tick after the neighbour ran. Virtual stage ``j = chunk * stages + stage``: with ``virtual``
chunks per stage (interleaved 1F1B) the model is cut into ``stages * virtual`` pieces and
stage ``s`` holds pieces ``s, s + stages, ...``.

Each stage's order of tasks comes from the schedule's rule (1F1B: ``stages - s - 1`` warm-up
forwards, then one forward / one backward, then the remaining backwards; interleaved: Megatron's
order over groups of ``stages`` micro-batches); :func:`build` turns the orders into ticks by
running them in lockstep.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

SCHEDULES = ("1f1b", "interleaved")


@dataclass(frozen=True)
class Task:
    """One unit of work of one stage: forward or backward of micro-batch ``micro`` on the
    stage's model chunk ``chunk``."""

    kind: str  # "F" or "B"
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    """``ticks[t][s]``: the task of stage ``s`` in tick ``t`` (None: idle)."""

    name: str
    stages: int
    micro_batches: int
    virtual: int
    ticks: tuple[tuple[Task | None, ...], ...]

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    @property
    def last_virtual(self) -> int:
        return self.stages * self.virtual - 1

    @property
    def predicted_bubble(self) -> float:
        """The idle fraction of the textbook schedule: (p-1)/(m+p-1), interleaved
        (p-1)/(v*m+p-1)."""
        p, m, v = self.stages, self.micro_batches, self.virtual
        return (p - 1) / (v * m + p - 1)

    @property
    def tick_bubble(self) -> float:
        """The idle fraction of these ticks (every task counted as one tick)."""
        busy = sum(t is not None for tick in self.ticks for t in tick)
        return 1.0 - busy / (len(self.ticks) * self.stages)

    def in_flight(self, stage: int) -> int:
        """The most micro-batch chunks whose forward ran on ``stage`` and whose backward has
        not (activations kept at once)."""
        live = peak = 0
        for tick in self.ticks:
            task = tick[stage]
            if task is not None:
                live += 1 if task.kind == "F" else -1
                peak = max(peak, live)
        return peak

    def summary(self) -> str:
        head = (
            f"pipeline schedule {self.name}: {self.stages} stages x {self.virtual} chunk(s), "
            f"{self.micro_batches} micro-batches, {len(self.ticks)} ticks; bubble "
            f"{self.predicted_bubble:.1%} predicted, {self.tick_bubble:.1%} in ticks"
        )
        rows = [
            f"  stage {s}: " + " ".join(f"{str(t[s]) if t[s] else '.':>5}" for t in self.ticks)
            for s in range(self.stages)
        ]
        return "\n".join([head, *rows])


def _orders_1f1b(p: int, m: int) -> list[list[Task]]:
    orders = []
    for s in range(p):
        warm = min(p - s - 1, m)
        order = [Task("F", i) for i in range(warm)]
        for i in range(m - warm):
            order += [Task("F", warm + i), Task("B", i)]
        order += [Task("B", i) for i in range(m - warm, m)]
        orders.append(order)
    return orders


def _orders_interleaved(p: int, m: int, v: int) -> list[list[Task]]:
    def task(kind: str, k: int) -> Task:
        group, within = divmod(k, p * v)
        chunk = within // p
        return Task(kind, group * p + within % p, chunk if kind == "F" else v - 1 - chunk)

    orders, total = [], m * v
    for s in range(p):
        warm = min((p - s - 1) * 2 + (v - 1) * p, total)
        order = [task("F", k) for k in range(warm)]
        for i in range(total - warm):
            order += [task("F", warm + i), task("B", i)]
        order += [task("B", k) for k in range(total - warm, total)]
        orders.append(order)
    return orders


def check_schedule_options(name: str, stages: int, micro_batches: int, virtual: int) -> None:
    """UserError naming what works, before anything runs."""
    if name not in SCHEDULES:
        raise UserError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    if stages < 1 or virtual < 1:
        raise UserError(f"pipeline stages and virtual stages must be >= 1, got {stages}, {virtual}")
    if name == "1f1b" and virtual != 1:
        raise UserError(
            f"--virtual-stages {virtual} needs --pp-schedule interleaved (1f1b has one chunk)"
        )
    if micro_batches < stages:
        raise UserError(
            f"{micro_batches} micro-batches per step cannot fill {stages} pipeline stages: use "
            f"at least {stages} (--micro-batch x --grad-accum micro-batches; raise --grad-accum)"
        )
    if name == "interleaved" and micro_batches % stages:
        valid = [k * stages for k in range(1, 4)]
        raise UserError(
            f"the interleaved schedule takes micro-batches in groups of the {stages} stages: "
            f"{micro_batches} is not a multiple of {stages} (e.g. {valid})"
        )


def build(name: str, stages: int, micro_batches: int, virtual: int = 1) -> Schedule:
    """The lockstep ticks of schedule ``name`` (``1f1b`` or ``interleaved``)."""
    check_schedule_options(name, stages, micro_batches, virtual)
    p, m, v = stages, micro_batches, virtual
    orders = _orders_1f1b(p, m) if name == "1f1b" else _orders_interleaved(p, m, v)
    return _lockstep(name, p, m, v, orders)


def forward_only(stages: int, micro_batches: int, virtual: int = 1) -> Schedule:
    """The ticks of forwards only (evaluation: no backward, nothing kept): each stage runs its
    chunks in order, every micro-batch of a chunk before the next chunk; any number (>= 1) of
    micro-batches."""
    if stages < 1 or virtual < 1 or micro_batches < 1:
        raise ValueError(f"forward_only({stages}, {micro_batches}, {virtual}): all must be >= 1")
    p, m, v = stages, micro_batches, virtual
    orders = [[Task("F", i, c) for c in range(v) for i in range(m)] for _ in range(p)]
    return _lockstep("forward", p, m, v, orders)


def _lockstep(name: str, p: int, m: int, v: int, orders: list[list[Task]]) -> Schedule:
    """Run each stage's order of tasks in lockstep: a task waits for the tick after the ones
    it depends on."""
    last = p * v - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, micro, virtual stage) -> tick
    pos, ticks, t = [0] * p, [], 0

    def ready(s: int, task: Task) -> bool:
        j = task.chunk * p + s
        if task.kind == "F":
            return j == 0 or done.get(("F", task.micro, j - 1), t) < t
        ran = done.get(("F", task.micro, j), t) < t
        return ran and (j == last or done.get(("B", task.micro, j + 1), t) < t)

    while any(pos[s] < len(orders[s]) for s in range(p)):
        tick = []
        for s in range(p):
            task = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
            tick.append(task if task is not None and ready(s, task) else None)
        if not any(tick):
            raise RuntimeError(f"schedule {name} p={p} m={m} v={v} deadlocks at tick {t}")
        for s, task in enumerate(tick):
            if task is not None:
                done[(task.kind, task.micro, task.chunk * p + s)] = t
                pos[s] += 1
        ticks.append(tuple(tick))
        t += 1
    return Schedule(name, p, m, v, tuple(ticks))

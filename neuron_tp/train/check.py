"""``neuron-tp train --check``: the whole job validated on one host before it is launched on
many, with no process group started and no weight read: the model's config, the layout
(:func:`neuron_tp.job.layout_rules.refusals`, the rules train and the planner apply), the
training and eval data at this layout's data-parallel degree, and the output directory. It
prints the layout (ranks per axis, the groups, what each rank holds) and returns 0, or every
problem found and 2."""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import UserError
from ..job.config import TrainConfig
from ..job.layout_rules import BatchShape, refusals
from ..parallel.layout import ParallelLayout, grid_side
from ..parallel.mesh import Mesh

Printer = Callable[[str], None]
AXES = ("pp", "dp", "cp", "tp")
MAX_RANK_LINES = 64  # larger jobs print the first and last ranks only


def world_of(config: TrainConfig) -> int:
    """``--world-size``, else ``$WORLD_SIZE``, else the smallest world of the degrees."""
    given = config.check.world_size or int(os.environ.get("WORLD_SIZE", "0") or 0)
    return given or config.tp * config.pipeline.pp * config.context.cp * config.ep


def check_job(config: TrainConfig, printer: Printer = print) -> int:
    """Validate the job ``config`` describes (see the module doc); 0 or 2."""
    layout = ParallelLayout.of(config, world_of(config))
    problems: list[str] = []
    hf_config, tokenizer = _model(config, problems)
    found = refusals(layout, BatchShape.of(config), hf_config)
    problems += found
    if tokenizer is not None and not layout.refusals():
        problems += _data_problems(config, tokenizer, layout)
    problems += _output_problems(config)
    if not layout.refusals():
        for line in describe(layout, hf_config):
            printer(line)
    if problems:
        printer(f"neuron-tp train --check: {len(problems)} problem(s):")
        for p in problems:
            printer(f"  - {p}")
        return 2
    printer("neuron-tp train --check: ok")
    return 0


def _model(config: TrainConfig, problems: list[str]):
    """(model config, tokenizer), or Nones with the reason appended to ``problems``."""
    from ..job.presets import model_config, preload
    from ..job.tokenizer import check_vocab, config_vocab, resolve_tokenizer

    try:
        preload(config.model)
        resolved = resolve_tokenizer(config.tokenizer, config.model)
        hf_config = model_config(config.model, resolved.size)
        check_vocab(resolved, config_vocab(hf_config), config.model)
    except (UserError, OSError) as e:
        problems.append(f"--model {config.model}: {e}")
        return None, None
    return hf_config, resolved.tokenizer


def _data_problems(config: TrainConfig, tokenizer, layout: ParallelLayout) -> list[str]:
    """The training (and eval) data read as rank 0 of this layout would read it."""
    from ..job.train_data import load_train_rows
    from . import preference

    out = []
    for what, path in (("--data", config.data), ("--eval-data", config.eval.data)):
        if path is None:
            continue
        try:
            training = what == "--data"
            if training:
                preference.check_options(config)
            data = load_train_rows(
                config, path, tokenizer, dp_size=layout.dp, training=training, in_order=True
            )
        except (UserError, OSError) as e:
            out.append(f"{what} {path}: {e}")
            continue
        if data.batches_per_epoch < 1:
            out.append(
                f"{what} {path}: {len(data.rows)} rows of {config.seq_len} tokens make no "
                f"batch of {data.global_batch} (--micro-batch x dp {layout.dp})"
            )
    return out


def _output_problems(config: TrainConfig) -> list[str]:
    """--output-dir: a directory this user can create and write (nothing is left in it)."""
    path = os.path.abspath(config.checkpoint.output_dir)
    above = path
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        return [f"--output-dir {config.checkpoint.output_dir}: {above} is a file"]
    if not os.access(above, os.W_OK | os.X_OK):
        return [f"--output-dir {config.checkpoint.output_dir}: {above} is not writable"]
    return []


def describe(layout: ParallelLayout, hf_config=None) -> list[str]:
    """The layout in words: ranks per axis, every axis's groups, what each rank holds."""
    mesh0 = Mesh.of(layout, 0, virtual=True)
    degrees = dict(zip(AXES, (layout.pp, layout.dp, layout.cp, layout.tp), strict=True))
    mode = layout.tp_mode + (", sequence parallel" if layout.sequence_parallel else "")
    lines = [
        f"layout: world {layout.world} = "
        + " x ".join(f"{a} {d}" for a, d in degrees.items())
        + f" (tp {mode}; ep {layout.ep}; attention {layout.attention})"
    ]
    for name in ("pp", "dp", "cp", "tp", "ep", "row", "col"):
        if name in mesh0.groups and mesh0.group(name).size > 1:
            groups = mesh0.group(name).all_groups
            shown = ", ".join(str(list(g)) for g in groups[:4])
            more = f", ... ({len(groups)} groups)" if len(groups) > 4 else ""
            lines.append(f"  {name} groups: {shown}{more}")
    ranks = list(range(layout.world))
    if len(ranks) > MAX_RANK_LINES:
        ranks = ranks[:8] + ranks[-8:]
    for r in ranks:
        lines.append(f"  rank {r}: {_holds(layout, Mesh.of(layout, r, virtual=True), hf_config)}")
    return lines


def _holds(layout: ParallelLayout, mesh: Mesh, hf_config) -> str:
    parts = []
    if layout.pp > 1:
        stage = mesh.pp.rank
        layers = getattr(hf_config, "num_hidden_layers", None)
        where = ""
        if layers is not None:
            from ..pipeline.stages import plan_stages

            try:
                plan = plan_stages(layers, layout.pp, layout.virtual_stages)
            except UserError:
                plan = None  # listed among the problems
            if plan is not None:
                pieces = plan.bounds[stage :: layout.pp]
                where = " layers " + ", ".join(
                    f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in pieces
                )
        parts.append(f"stage {stage}{where}")
    parts.append(f"data replica {mesh.dp_rank} of {layout.dp}")
    if layout.cp > 1:
        c = mesh.group("cp").rank
        parts.append(f"sequence chunks {c} and {2 * layout.cp - 1 - c} of {2 * layout.cp}")
    if layout.tp > 1:
        t = mesh.tp.rank
        if layout.tp_mode == "1d":
            parts.append(f"tp shard {t} of {layout.tp} (heads and MLP columns)")
        else:
            q = grid_side(layout.tp, layout.tp_mode)
            parts.append(f"grid cell {t} of a {layout.tp_mode} grid of side {q}")
    if layout.ep > 1:
        parts.append(f"experts block {mesh.group('ep').rank} of {layout.ep}")
    return "; ".join(parts)

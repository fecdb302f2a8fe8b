"""``neuron-tp train --plan auto``: the training options of the layout the plan recommends
for this job (its world size and ranks per node, its model, sequence length and global
batch). Every rank plans alone (deterministic: the same options everywhere, checked by the
startup agreement), before the job's runtime starts; the result is cached on disk
(``$NEURON_TP_CACHE``, default ``~/.cache/neuron_tp``), so the ranks of a node plan once
between them and a resumed job does not plan again."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict


def job_size(config) -> tuple[int, int]:
    """(world size, ranks per node) of the job this process belongs to."""
    if config.xla_cpu_devices:
        return config.xla_cpu_devices, config.xla_cpu_devices
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def _model_config(config):
    from ..job.data import load_tokenizer, vocab_size
    from ..job.presets import is_preset, model_config
    from .models import plan_config

    if is_preset(config.model):
        return model_config(config.model, vocab_size(load_tokenizer(config.tokenizer)))
    return plan_config(config.model, config.seq_len)


def excluded_axes(config, model_config) -> dict[str, str]:
    """The parallel axes (pp, cp) ``--plan auto`` keeps at 1 for this job, each with why: what
    ``neuron-tp train`` refuses of this model on that axis
    (:mod:`neuron_tp.job.layout_rules`), and what this build does not plan (--ep beside
    them), so the plan never picks a layout the job then refuses."""
    from ..job.config import AUTO_PLAN_AXES
    from ..job.layout_rules import cp_model_refusals, pp_model_refusals

    why: dict[str, list[str]] = {"pp": [], "cp": []}
    for axis, reasons in why.items():
        if axis not in AUTO_PLAN_AXES:
            reasons.append("this build does not plan it")
        if config.ep > 1:
            reasons.append(f"--ep {config.ep} (the plan does not predict experts beside it)")
    why["pp"] += pp_model_refusals(model_config, config.seq_len)
    why["cp"] += cp_model_refusals(model_config)
    return {axis: "; ".join(reasons) for axis, reasons in why.items() if reasons}


def apply_plan(config, printer=print):
    """``config`` (a TrainConfig with ``plan="auto"``) with the recommended layout's options
    (pp and its schedule, and cp, too, where :func:`excluded_axes` allows them); ValueError
    when the job has no layout that fits (the plan's verdict)."""
    from .layouts import Layout
    from .report import plan_table
    from .search import make_plan

    if config.plan.global_batch <= 0:
        raise ValueError("--plan auto needs --global-batch N (sequences per optimizer step)")
    if config.tp_mode != "1d" or config.tp != 1:
        printer("--plan auto: the plan chooses --tp/--tp-mode; the given values are ignored")
    if config.lora.r:
        printer(
            "--plan auto: the plan predicts full training; with --lora-r its optimizer state "
            "and gradients are over-estimates (the layout is a conservative one)"
        )
    job = auto_job(config, printer)
    model_config = _model_config(config)
    excluded = excluded_axes(config, model_config)
    pins = {axis: 1 for axis in excluded}

    def plan_now() -> dict:
        plan = make_plan(model_config, job, **pins)
        plan.model = config.model
        best = plan.recommended
        return {
            "layout": asdict(best.layout) if best else None,
            "table": plan_table(plan, 5),
            "verdict": plan.verdict,
        }

    result = cached(_key(model_config, job) + "".join(sorted(pins)), plan_now)
    for axis, why in sorted(excluded.items()):
        printer(f"--plan auto: --{axis} kept at 1 ({why})")
    if result["layout"] is None:
        raise ValueError(f"--plan auto: {result['verdict']}")
    printer(result["table"])
    return applied(config, Layout(**result["layout"]))


def auto_job(config, printer=print):
    """The :class:`~.layouts.Job` ``--plan auto`` plans for: this job's size, the instance
    (calibrated with ``--plan-calibration``), sequence length, global batch and precision."""
    from .hardware import get_instance
    from .layouts import Job

    world, per_node = job_size(config)
    if world % per_node:
        raise ValueError(f"world size {world} is not a multiple of {per_node} ranks per node")
    instance, efficiency = get_instance(config.plan.instance), 0.5
    if config.plan.calibration:
        from .calibration import calibrated, describe, load_calibration

        calibration = load_calibration(config.plan.calibration)
        printer(f"--plan auto: {describe(instance, calibration)}")
        instance = calibrated(instance, calibration)
        efficiency = 1.0 if calibration.has_compute else efficiency
    return Job(
        instance,
        world // per_node,
        config.seq_len,
        config.plan.global_batch,
        bf16=config.bf16,
        efficiency=efficiency,
        ranks_per_node=per_node,
        objective=config.preference.objective,
        reference=config.preference.reference,
    )


def applied(config, layout):
    """``config`` with ``layout``'s training options (tp and its mode, the batch split,
    recompute, ZeRO-1, pp and its schedule, cp, attention)."""
    from ..job.options import with_values

    options = layout.train_options()
    options["zero1"] = layout.zero1 and not config.bf16  # --bf16 brings ZeRO-1 itself
    return with_values(config, options)


def _key(model_config, job) -> str:
    """What the plan depends on: the model, the job, and the planner's own code."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = hashlib.sha256()
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as fh:
                code.update(fh.read())
    what = {
        "model": model_config.to_dict(),
        "job": {**asdict(job), "instance": asdict(job.instance)},
        "code": code.hexdigest(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def cached(key: str, compute: Callable[[], dict]) -> dict:
    """``compute()`` once per ``key`` on this machine: the first caller computes under a
    file lock while the others wait, then every caller reads the stored result."""
    root = os.path.join(
        os.environ.get("NEURON_TP_CACHE") or os.path.expanduser("~/.cache/neuron_tp"), "plans"
    )
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"{key}.json")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            pass
        result = compute()
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(result, fh)
        os.replace(tmp, path)
        return result


def rank0_printer(*args, **kwargs) -> None:
    """Print on rank 0 of the job only."""
    if os.environ.get("RANK", "0") == "0":
        print(*args, **kwargs, file=sys.stdout, flush=True)

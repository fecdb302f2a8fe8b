"""Everything that decides the shape of the compiled graphs, in one place.

- one ``mark_step`` per optimizer step (:func:`step_boundary`), nothing else cuts the graph;
- host reads only inside step closures (:func:`on_step_end`), which the training loop
  registers at log intervals only;
- ``NEURON_EXTRACT_GRAPHS_ONLY`` (set by ``neuron_parallel_compile``) detection;
- ``NEURON_CC_FLAGS`` defaults on Neuron that never replace a flag the user set;
- graph / compile / transfer counters read from ``torch_xla.debug.metrics``.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable

import torch

from . import xla as _xla

DEFAULT_CC_FLAGS = ("--model-type=transformer",)


def extract_graphs_only() -> bool:
    """True in ``neuron_parallel_compile``'s trial run: graphs are traced, values are dummies."""
    return os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY", "").lower() not in ("", "0", "false")


def merged_cc_flags(
    user: str, defaults: tuple[str, ...] = DEFAULT_CC_FLAGS, cache_dir: str | None = None
) -> str:
    """``user`` flags plus each default whose option the user did not set (space-separated).

    The user's flags come first and are kept verbatim; a default is skipped when the same
    option name (the part before ``=``) is already present."""
    tokens = shlex.split(user or "")
    names = {t.split("=", 1)[0] for t in tokens}
    extra = [d for d in defaults if d.split("=", 1)[0] not in names]
    if cache_dir and "--cache_dir" not in names:
        extra.append(f"--cache_dir={cache_dir}")
    return " ".join(tokens + extra)


def apply_neuron_defaults(environ=os.environ) -> None:
    """On Neuron: default ``NEURON_CC_FLAGS`` (transformer model type), never clobbering."""
    if _xla.on_neuron():
        environ["NEURON_CC_FLAGS"] = merged_cc_flags(environ.get("NEURON_CC_FLAGS", ""))


def step_boundary(device: torch.device) -> None:
    """End of one optimizer step: cut and launch the graph (XLA); nothing on eager devices."""
    if device.type == "xla":
        _xla.xm().mark_step()


def on_step_end(device: torch.device, fn: Callable, *tensors: torch.Tensor) -> None:
    """Call ``fn(*tensors)`` once the step's values exist: an XLA step closure (runs after
    the graph executed, so reading values costs no extra graph), immediately elsewhere."""
    if device.type == "xla":
        _xla.xm().add_step_closure(fn, tensors)
    else:
        fn(*tensors)


def _metric_count(name: str) -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return int(data[0]) if data else 0


def graph_counters() -> dict[str, int]:
    """``compiles`` (XLA graph compilations) and ``transfers_to_host`` so far in this process;
    zeros when torch-xla was never imported (eager CPU runs)."""
    import sys

    if "torch_xla" not in sys.modules:
        return {"compiles": 0, "transfers_to_host": 0}
    return {
        "compiles": _metric_count("CompileTime"),
        "transfers_to_host": _metric_count("TransferFromDeviceTime"),
    }


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of the device (XLA memory info) or the process max RSS, in MiB."""
    if device.type == "xla":
        try:
            info = _xla.xm().get_memory_info(device)
            peak = info.get("peak_bytes_used") or info.get("bytes_used") or 0
            if peak:
                return peak / 2**20
        except Exception:  # noqa: BLE001 - not every PJRT plugin reports memory
            pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

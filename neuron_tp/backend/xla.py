"""Lazy access to torch-xla. Importing neuron_tp never imports torch_xla (it costs seconds and
may be absent); these helpers import it on first use."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch


def available() -> bool:
    """True when torch-xla is installed."""
    return importlib.util.find_spec("torch_xla") is not None


def on_neuron() -> bool:
    """True when this process runs on NeuronCores (PJRT device NEURON or a Neuron device node)."""
    if os.environ.get("PJRT_DEVICE"):
        return os.environ["PJRT_DEVICE"].upper() == "NEURON"
    return os.path.exists("/dev/neuron0")


def is_xla(t: torch.Tensor) -> bool:
    return t.device.type == "xla"


@functools.cache
def set_in_place(t: torch.Tensor, value) -> None:
    """Write ``value`` (a number, or a tensor of ``t``'s element count) into ``t`` in place, in
    ``t``'s own shape. On XLA a ``copy_`` from a source of another rank (a 0-d value into a
    ``[1]`` device lr) gives ``t`` device data of the source's shape while its sizes stay
    ``[1]`` (torch-xla 2.9); once a graph cut materialises it apart from the graph that reads it
    (a pipeline stage cuts between tasks), the next copy fails with "dimensionality of sizes (0)
    must match dimensionality of strides (1)"."""
    t.copy_(torch.as_tensor(value, dtype=t.dtype).reshape(t.shape))


def cpu_runtime() -> bool:
    """True when the XLA runtime is torch-xla's CPU client (``PJRT_DEVICE=CPU``): its devices
    (``CPU_NUM_DEVICES=N`` under ``xmp.spawn``) are threads of one process, and collectives
    between them only meet when they carry channel ids. False on Neuron. Cached: the
    runtime's device type never changes."""
    import torch_xla.runtime as xr

    return xr.device_type() == "CPU"


def cpu_devices_env(n: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables that make torch-xla's CPU runtime run ``n`` devices (one thread
    each under ``xmp.spawn``) that execute collectives together, reliably:

    - ``CPU_NUM_DEVICES=n`` and ``XLA_THREAD_POOL_SIZE >= n`` (a smaller pool deadlocks: every
      device of a collective needs a thread);
    - ``XLA_ENABLE_PARAM_ALIASING=0``: with buffer donation, dropping the last reference to a
      donated buffer blocks until the graph using it finishes, and torch-xla does that while
      holding the GIL (e.g. replacing the collective ordering token). The graph waits in a
      collective for another device thread, which waits for the GIL: a deadlock that XLA:CPU
      aborts after 10 s. Only the CPU runtime has it (Neuron ranks are separate processes);
      aliasing saves memory, never changes values;
    - LLVM ``-O0`` unless ``XLA_FLAGS`` chooses a level: each device thread compiles its own
      copy of every graph, and XLA:CPU aborts a collective whose devices arrive more than
      ~10 s apart; unoptimised code compiles several times faster.
    """
    flags = (environ or os.environ).get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        flags = f"{flags} --xla_backend_optimization_level=0".strip()
    return {
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": str(n),
        "XLA_THREAD_POOL_SIZE": str(max(8, n)),
        "XLA_ENABLE_PARAM_ALIASING": "0",
        "XLA_FLAGS": flags,
    }


def runtime_world() -> tuple[int, int] | None:
    """``(world size, global ordinal)`` of this thread from the XLA runtime when torch-xla is
    in use and the runtime spans several devices (torchrun on Neuron, or ``xmp.spawn`` threads
    on the CPU, where ``torch.distributed.get_rank()`` would say 0 for every thread); else
    None."""
    if "torch_xla" not in sys.modules:
        return None
    import torch_xla.runtime as xr

    world = xr.world_size()
    return (world, xr.global_ordinal()) if world > 1 else None


def xm():
    """The ``torch_xla.core.xla_model`` module."""
    import torch_xla.core.xla_model as xla_model

    return xla_model


def wait_own_device() -> None:
    """Wait for the pending work of this thread's XLA device only. Under ``--xla-cpu-devices``
    the other ranks are threads of this process whose devices may wait in a collective for
    this one: waiting for every device (``xm.wait_device_ops()``) could deadlock until XLA:CPU
    aborts the collective. On Neuron (one device per process) the same as waiting for all."""
    import torch_xla

    X = torch_xla._XLAC
    xm().wait_device_ops(X._xla_real_devices([X._xla_get_default_device()]))


def device() -> torch.device:
    """The XLA device of this process (a NeuronCore on Neuron, the CPU PJRT device elsewhere).

    Call it before the first ``backward()`` of the process: PyTorch's autograd engine sizes its
    per-device queues once, and a device type registered later makes backward fail.
    """
    if not os.environ.get("PJRT_DEVICE"):
        os.environ["PJRT_DEVICE"] = "NEURON" if on_neuron() else "CPU"
    import torch_xla

    return torch_xla.device()

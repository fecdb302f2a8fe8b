"""Run a test body on several CPU processes joined by gloo (the multi-rank test harness)."""
from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(*args)
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        import neuron_tp
        neuron_tp.set_default_mesh(None)


def run(fn, world_size: int, *args, timeout: float = 300) -> None:
    """Call ``fn(*args)`` on ``world_size`` gloo ranks; re-raise the first rank's failure.

    ``fn`` must be a module-level function (it is pickled into spawned processes); inside it
    ``neuron_tp.init_mesh`` finds the process group already initialised.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with codes {bad} (timeout {timeout}s?)")


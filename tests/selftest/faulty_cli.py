"""``neuron-tp`` with one collective broken UNDERNEATH neuron_tp (test-only): the
torch.distributed / torch-xla functions that ``neuron_tp.parallel.comm`` calls are wrapped, never
comm itself. ``SELFTEST_FAULT`` picks the faults (comma-separated):

- ``wrong_chunk``: all-gather returns the first two ranks' chunks swapped;
- ``lost_rank``: rank 1's contribution to every all-reduce is lost (zeros);
- ``inexact_bf16``: bf16 reduce-scatter sums come back off by a relative 2^-6;
- ``no_arrive``: rank 1 never arrives in its first bf16 all-reduce;
- ``env_mismatch`` (gloo): two "nodes" of 2 ranks, one compile cache each (allowed), and
  rank 3 started with other compiler flags (not allowed).

Installed at import, before ``--xla-cpu-devices`` forks the ranks' process from this one, so
the ranks run with the fault too.
"""

from __future__ import annotations

import os
import sys
import time

import torch

FAULTS = set(os.environ.get("SELFTEST_FAULT", "").split(",")) - {""}


def _swap_first_chunks(out: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    parts = list(out.chunk(n, dim))
    return torch.cat([parts[1], parts[0], *parts[2:]], dim)


def _stall(rank: int, dtype: torch.dtype) -> None:
    if "no_arrive" in FAULTS and rank == 1 and dtype == torch.bfloat16:
        time.sleep(3600)


def _install_gloo() -> None:
    import torch.distributed as dist

    gather, reduce, scatter = (
        dist.all_gather_into_tensor,
        dist.all_reduce,
        dist.reduce_scatter_tensor,
    )

    def all_gather_into_tensor(out, src, group=None, async_op=False):
        work = gather(out, src, group=group, async_op=async_op)
        if "wrong_chunk" in FAULTS:
            out.copy_(_swap_first_chunks(out, dist.get_world_size(group), 0))
        return work

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        rank = dist.get_rank()
        _stall(rank, t.dtype)
        if "lost_rank" in FAULTS and rank == 1:
            t.zero_()
        return reduce(t, op=op, group=group, async_op=async_op)

    def reduce_scatter_tensor(out, src, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = scatter(out, src, op=op, group=group, async_op=async_op)
        if "inexact_bf16" in FAULTS and out.dtype == torch.bfloat16:
            out.mul_(1 + 2**-6)
        return work

    dist.all_gather_into_tensor, dist.all_reduce = all_gather_into_tensor, all_reduce
    dist.reduce_scatter_tensor = reduce_scatter_tensor


def _install_xla() -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    gather, reduce, scatter = xm.all_gather, torch_xla._XLAC._xla_spmd_all_reduce, xm.reduce_scatter

    def all_gather(x, dim=0, groups=None, **kw):
        out = gather(x, dim=dim, groups=groups, **kw)
        if "wrong_chunk" in FAULTS:
            out = _swap_first_chunks(out, len(groups[0]), dim)
        return out

    def spmd_all_reduce(kind, x, scale, groups):
        _stall(xr.global_ordinal(), x.dtype)
        if "lost_rank" in FAULTS and xr.global_ordinal() == 1:
            x = x * 0
        return reduce(kind, x, scale, groups)

    def reduce_scatter(kind, x, scale, scatter_dim, shard_count, **kw):
        out = scatter(kind, x, scale, scatter_dim, shard_count, **kw)
        if "inexact_bf16" in FAULTS and x.dtype == torch.bfloat16:
            out = out * (1 + 2**-6)
        return out

    xm.all_gather, torch_xla._XLAC._xla_spmd_all_reduce = all_gather, spmd_all_reduce
    xm.reduce_scatter = reduce_scatter


def _mismatch_env() -> None:
    rank = int(os.environ.get("RANK", "0"))
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    flags = f"--model-type=transformer --cache_dir=/tmp/cache/node-{rank // 2}"
    os.environ["NEURON_CC_FLAGS"] = flags + (" -O2" if rank == 3 else "")


if "env_mismatch" in FAULTS:
    _mismatch_env()
if FAULTS:
    # --xla-cpu-devices: the launcher, patched here, forks the ranks' process (which has
    # CPU_NUM_DEVICES set, were it spawned and imported this again); gloo ranks have neither.
    xla = "--xla-cpu-devices" in sys.argv or "CPU_NUM_DEVICES" in os.environ
    _install_xla() if xla else _install_gloo()

if __name__ == "__main__":
    from neuron_tp.cli.entry import main

    sys.exit(main())

"""Sharded, atomic, verified, resumable checkpoints.

Layout of one checkpoint ``ROOT/step-00000100/``::

    meta.json                      mesh, model class + config, layout of every parameter,
                                   optimizer/scheduler state, data position
    shard-tp00000.safetensors      the tp rank's parameters and optimizer states (written by
    ...                            the ranks of data-parallel replica 0), a CRC-32 per tensor;
                                   tp rank 0's also the persistent buffers (replicated,
                                   ``buffer/<name>``; meta.json's ``buffers`` lists them)
    optim-tp00000-dp00000.safetensors   ZeRO-1 only: each (tp, dp) rank's own shard of the
    ...                            optimizer state and fp32 masters (none in shard-tp*; the
                                   metadata's optimizer.dp_shards says at which dp)
    shard-pp00001-tp00000.safetensors   at pp > 1 (pipeline stages): each stage's own
    optim-pp00001-tp00000-dp00000...    parameters (and ZeRO-1 state), a tied table once (by
                                   the first stage); meta.json lists every stage's
                                   parameters, each with its ``stage``, in the pp 1 order
    rng-rank00000.safetensors/json each rank's RNG states
    tokenizer/, generation_config.json   the run's tokenizer files (meta.json's
                                   extra.tokenizer says which, or "bytes") and the model's
                                   generation config, when it has one (:mod:`.assets`)

All ranks write (and fsync) into ``ROOT/.tmp-step-00000100``; rank 0 renames it only after
every rank finished, so an interrupted or failed save never touches an earlier checkpoint and
an incomplete directory is never picked up by :func:`latest`. A failure of any kind on any
rank, in save or load, raises :class:`CheckpointError` on every rank (no rank is left waiting)
and commits / modifies nothing. No tensor is pickled.

Modules: :mod:`.format` (names, checksums, durable writes), :mod:`.agree` (failure agreement),
:mod:`.writer` (save), :mod:`.reader` (load), :mod:`.merge` (consolidate), :mod:`.int8_export`
(consolidate to neuron_tp's int8 directory), :mod:`.reshard` (layouts), :mod:`.assets` (tokenizer
and generation config files), :mod:`.zero1_files` (dp-sharded ZeRO-1 state), :mod:`.buffers`
(persistent buffers), :mod:`.outdir` (output directory checks, job lock, resume plan).
"""

from __future__ import annotations

from .format import FORMAT, CheckpointError, latest, read_meta
from .int8_export import consolidate_int8
from .merge import consolidate, full_optimizer_state
from .reader import load
from .writer import dry_run_save, save

__all__ = [
    "save",
    "load",
    "latest",
    "consolidate",
    "consolidate_int8",
    "full_optimizer_state",
    "read_meta",
    "dry_run_save",
    "CheckpointError",
    "FORMAT",
]

"""Check 1: the environment of every rank (versions, devices, compiler flags, compile cache),
and that all ranks agree on it."""

from __future__ import annotations

import glob
import os
import re
import shlex
from importlib import metadata

from ..parallel.agreement import RankMismatchError, check_agreement
from .context import Context
from .report import Check

PACKAGES = ("torch", "torch-xla", "transformers", "neuron_tp")
NEURON_PACKAGES = ("torch-neuronx", "neuronx-cc", "libneuronxla", "neuronx-distributed")
DEFAULT_CACHE = "/var/tmp/neuron-compile-cache"


def _version(name: str) -> str | None:
    """The installed version of ``name`` from its metadata (the package is not imported)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def runtime_version() -> str | None:
    """The Neuron runtime library's version, from its file name (None when absent)."""
    found = sorted(glob.glob("/opt/aws/neuron/lib/libnrt.so.*"))
    return os.path.basename(found[-1]).removeprefix("libnrt.so.") if found else None


def compile_cache(environ=os.environ) -> str:
    """Where the Neuron compiler caches graphs: ``--cache_dir=`` in ``NEURON_CC_FLAGS`` wins,
    then ``NEURON_COMPILE_CACHE_URL``, then the default."""
    for token in shlex.split(environ.get("NEURON_CC_FLAGS", "")):
        if token.startswith("--cache_dir="):
            return token.split("=", 1)[1]
    return environ.get("NEURON_COMPILE_CACHE_URL") or DEFAULT_CACHE


def flags_without_cache(environ=os.environ) -> str:
    """``NEURON_CC_FLAGS`` without its ``--cache_dir=`` (one cache per node is the rule)."""
    tokens = shlex.split(environ.get("NEURON_CC_FLAGS", ""))
    return " ".join(t for t in tokens if not t.startswith("--cache_dir="))


def facts(ctx: Context) -> dict:
    """This rank's environment: what must agree across ranks, and where it runs."""
    versions = {p: _version(p) for p in PACKAGES}
    versions.update({p: v for p in NEURON_PACKAGES if (v := _version(p))})
    if ctx.on_neuron:
        versions["neuron-runtime"] = runtime_version()
    if ctx.on_xla:
        import torch_xla.runtime as xr

        kind = xr.device_type()
    else:
        kind = "cpu (gloo)"
    return {
        "versions": versions,
        "device": kind,
        "world": ctx.world,
        "ranks_per_node": ctx.ranks_per_node,
        "NEURON_CC_FLAGS": flags_without_cache(),
        "compile_cache": compile_cache() if ctx.on_neuron else "n/a (not on Neuron)",
        "tp": ctx.mesh.tp_size,
        "dp": ctx.mesh.dp_size,
    }


def check_env(ctx: Context) -> Check:
    """Every rank's facts, compared on the host; a difference fails (and stops the run). The
    compile cache must agree within a node only, ``NEURON_CC_FLAGS`` without its
    ``--cache_dir``."""
    c = Check("environment")
    mine = facts(ctx)
    ctx.facts.update(mine)
    per = ctx.ranks_per_node
    nodes = [list(range(n, min(n + per, ctx.world))) for n in range(0, ctx.world, per)]
    try:
        check_agreement(
            dict(mine),
            ctx.mesh.group("world"),
            scopes={"compile_cache": nodes},  # one cache per node (k8s/train.yaml does so)
            details={"versions": mine["versions"]},
            what="selftest environment",
        )
    except RankMismatchError as e:
        c.fail(re.sub(r"\s+", " ", str(e)))
        c.hint = (
            "start every rank from the same image / venv and the same environment "
            "(NEURON_CC_FLAGS, versions); the lines above name the ranks that differ"
        )
    v = mine["versions"]
    shown = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    c.summary = (
        f"{mine['device']} x {ctx.world} ({ctx.ranks_per_node}/node, tp {mine['tp']} x dp "
        f"{mine['dp']}); {shown}; NEURON_CC_FLAGS={mine['NEURON_CC_FLAGS']!r}; "
        f"cache {mine['compile_cache']}"
    )
    c.numbers = mine
    return c

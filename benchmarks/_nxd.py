"""Load neuronx-distributed (NxD) from its source mirror for CPU benchmarks, without Neuron.

NxD is not installed here and needs the Neuron SDK to import as a package. Its 1D tensor-parallel
layers and loss also run on a gloo process group in its CPU mode (``NXD_CPU_MODE=1``), which is
how the benchmarks compare against it. :func:`load_nxd`:

1. exports ``src/neuronx_distributed`` of the mirror's ``HEAD`` once into a cache directory
   (``$NEURON_TP_CACHE`` or ``~/.cache/neuron_tp``, under ``nxd/<commit>``);
2. registers an empty ``neuronx_distributed`` package whose ``__path__`` is that tree, so its
   top-level ``__init__.py`` (which imports NKI kernels) never runs and submodules import
   normally;
3. stubs the two Neuron SDK names read at import time only: ``torch_neuronx.utils.
   get_platform_target`` (returns ``"trn1"``) and ``neuronxcc.nki._private_kernels.
   collectives.CollectivesConfig`` (built at initialisation, used only by ring
   attention). Nothing on a math path is replaced.

Then, in each gloo rank::

    nxd = load_nxd()
    nxd_init(tp)  # parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import types

MIRROR = os.environ.get("NXD_MIRROR", "/work/.mirror/aws-neuron+neuronx-distributed/repo")


def _cache_dir() -> str:
    return os.environ.get("NEURON_TP_CACHE", os.path.expanduser("~/.cache/neuron_tp"))


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={MIRROR}", *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def _export() -> str:
    """The exported source tree (``.../src``) of the mirror's HEAD, made on first use."""
    if not os.path.isdir(MIRROR):
        raise RuntimeError(
            f"neuronx-distributed mirror not found at {MIRROR} (a bare git clone of "
            "aws-neuron/neuronx-distributed); set NXD_MIRROR to its git dir"
        )
    commit = _git("rev-parse", "HEAD")
    root = os.path.join(_cache_dir(), "nxd", commit)
    src = os.path.join(root, "src")
    if not os.path.isfile(os.path.join(src, "neuronx_distributed", "__init__.py")):
        tmp = f"{root}.tmp{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        archive = subprocess.run(
            ["git", f"--git-dir={MIRROR}", "archive", commit, "src/neuronx_distributed"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        try:
            os.rename(tmp, root)
        except OSError:  # another process won the race: use its copy
            subprocess.run(["rm", "-rf", tmp], check=True)
    return src


def _stub(name: str, **attrs) -> None:
    """An import-only module ``name`` (and its parents) unless a real one exists."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            mod = types.ModuleType(sub)
            mod.__path__ = []
            sys.modules[sub] = mod
            if i > 1:
                setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], mod)
    for k, v in attrs.items():
        if not hasattr(sys.modules[name], k):
            setattr(sys.modules[name], k, v)


class _CollectivesConfig:
    """NxD builds one in ``initialize_model_parallel`` to keep the ring-attention send/receive
    pairs of this rank. Here every rank's pairs are None: NxD's ring attention (not benchmarked)
    then fails its own "not initialized" assertion instead of running with made-up pairs."""

    def __init__(self, replica_groups=None, **kwargs):
        self.rank_src_tgt_pairs = collections.defaultdict(lambda: None)


def load_nxd() -> types.ModuleType:
    """Register NxD's source tree as the ``neuronx_distributed`` package (CPU mode) and return
    it. Idempotent. Raises RuntimeError when the mirror is missing."""
    os.environ["NXD_CPU_MODE"] = "1"
    if "neuronx_distributed" in sys.modules:
        return sys.modules["neuronx_distributed"]
    src = _export()
    _stub("torch_neuronx.utils", get_platform_target=lambda: "trn1")
    _stub("neuronxcc.nki._private_kernels.collectives", CollectivesConfig=_CollectivesConfig)
    pkg = types.ModuleType("neuronx_distributed")
    pkg.__path__ = [os.path.join(src, "neuronx_distributed")]
    pkg.__file__ = os.path.join(src, "neuronx_distributed", "__init__.py")
    sys.modules["neuronx_distributed"] = pkg
    return pkg


def nxd_init(tp: int) -> None:
    """NxD's tensor-parallel groups of size ``tp`` on the already-initialised default (gloo)
    process group."""
    load_nxd()
    from neuronx_distributed.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)

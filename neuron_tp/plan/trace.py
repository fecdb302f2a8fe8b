"""One rank's training step, traced on the XLA device and never run.

The transformers model is built on the meta device, sharded by :func:`neuron_tp.hf.parallelize`
for one rank of a virtual mesh (``tp x dp`` ranks), given activation recompute as
``neuron-tp train`` does, and its parameters become lazy XLA zeros (one IR node each: no
memory). Then the step of :mod:`neuron_tp.train.loop` is traced: forward + backward of one
micro-batch, then :func:`~neuron_tp.optim.grads.reduce_gradients` and the optimizer step. Read
off the graph: every collective (kind, bytes, the ranks it spans), the FLOPs of every matrix
product, and the bytes autograd saves for backward (parameters excluded).

Traces run in a child process (:func:`trace_in_subprocess`): torch-xla must run on its CPU
device there, and a virtual mesh's graph can never execute, so each trace's pending IR is
dropped before the next.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from math import prod

import torch

_DOT = re.compile(
    r"=\s*(?P<out>[a-z]+\d*\[[\d,]*\])\S*\s+dot\((?P<lhs>[a-z]+\d*\[[\d,]*\])"
    r".*lhs_contracting_dims=\{(?P<k>[\d,]*)\}"
)


@dataclass(frozen=True)
class Spec:
    """What to trace: the layout of one rank and the job size around it."""

    tp: int
    tp_mode: str = "1d"
    sequence_parallel: bool = False
    recompute: str = "none"  # neuron_tp.hf.recompute: none | selective | full
    micro_batch: int = 1
    seq_len: int = 128
    dp: int = 1
    zero1: bool = False
    bf16: bool = True
    layers: int = 1  # decoder layers of the traced model
    max_grad_norm: float = 1.0
    attn: str = "sdpa"  # attention implementation (neuron-tp train loads "sdpa"), or "blockwise"
    attention_block: int = 0  # blockwise: key/value block (0: the whole sequence, one tile)


@dataclass(frozen=True)
class Comm:
    """One collective of the traced graph, as this rank sees it."""

    kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all
    buffer_bytes: int  # the full buffer (all-gather output, all-reduce/reduce-scatter input)
    ring_bytes: float  # bytes this rank sends with a ring algorithm
    group: tuple[int, ...]  # the world ranks of this rank's group


@dataclass(frozen=True)
class Trace:
    """A traced micro-batch (forward + backward) and the once-per-step remainder."""

    flops: int  # matrix-product FLOPs of forward + backward (recompute included)
    saved_bytes: int  # tensors autograd keeps between forward and backward
    micro: tuple[Comm, ...]  # collectives of forward + backward
    step: tuple[Comm, ...]  # collectives of the gradient reduction and optimizer step


def dot_flops(hlo: str) -> int:
    """2 x output elements x contracted length, summed over the ``dot`` ops of ``hlo``."""
    total = 0
    for m in _DOT.finditer(hlo):
        out = [int(d) for d in re.findall(r"\d+", m["out"].split("[")[1])]
        lhs = [int(d) for d in re.findall(r"\d+", m["lhs"].split("[")[1])]
        k = prod(lhs[int(i)] for i in m["k"].split(",") if i)
        total += 2 * prod(out) * k
    return total


def _comms(hlo: str, rank: int) -> list[Comm]:
    from ..backend.hlo import parse_collectives

    found = []
    for c in parse_collectives(hlo):
        group = next((g for g in c.replica_groups if rank in g), (rank,))
        found.append(Comm(c.kind, c.buffer_bytes, c.ring_bytes, tuple(group)))
    return found


def _minus(total: list[Comm], part: list[Comm]) -> list[Comm]:
    """The collectives of ``total`` that are not in ``part`` (a multiset difference)."""
    rest = list(total)
    for c in part:
        rest.remove(c)
    return rest


def _lazy_zeros(model: torch.nn.Module, device) -> None:
    """Replace every (meta) parameter by zeros on ``device`` (lazy: no memory), ties kept."""
    new: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if id(p) not in new:
                z = torch.zeros(p.shape, dtype=p.dtype, device=device)
                new[id(p)] = torch.nn.Parameter(z, requires_grad=p.requires_grad)
            setattr(mod, name, new[id(p)])
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None:
                mod._buffers[name] = b.to(device)


def sharded_meta_model(config, spec: Spec, rank: int = 0):
    """``config``'s causal LM on the meta device, sharded as ``neuron-tp train`` shards it
    for world rank ``rank`` of a virtual ``spec.tp x spec.dp`` mesh; returns (model, mesh)."""
    from transformers import AutoModelForCausalLM

    from .. import hf
    from ..hf.loading import params_on_meta
    from ..hf.recompute import apply_activation_checkpointing
    from ..parallel.mesh import Mesh

    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    mesh = Mesh.virtual(spec.tp * spec.dp, rank, tp=spec.tp, tp_mode=spec.tp_mode)
    hf.parallelize(model, mesh, sequence_parallel=spec.sequence_parallel, parallel_loss=spec.tp > 1)
    if spec.attn == "blockwise":  # as neuron-tp train --attention blockwise
        from ..hf.attention import use_blockwise_attention

        use_blockwise_attention(model, spec.attention_block or spec.seq_len)
    apply_activation_checkpointing(model, spec.recompute)
    return model, mesh


def trace_step(config, spec: Spec, rank: int = 0) -> Trace:
    """Trace one training step of world rank ``rank`` (in this process, on the XLA device)."""
    import copy

    import torch_xla

    from ..backend.hlo import trace_hlo
    from ..optim.adamw import make_optimizer
    from ..optim.grads import reduce_gradients

    config = copy.deepcopy(config)
    config.num_hidden_layers = spec.layers
    config._attn_implementation = "sdpa" if spec.attn == "blockwise" else spec.attn
    device = torch_xla.device()
    torch_xla._XLAC._clear_pending_irs(str(device))  # a virtual graph never runs: drop it
    model, mesh = sharded_meta_model(config, spec, rank)
    _lazy_zeros(model, device)
    model.train()
    params = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # A view (a weight's transpose, a reshape) holds its base's memory: count bases, once.
        base = t
        while base._base is not None:
            base = base._base
        if id(base) not in params:
            saved[id(base)] = base.numel() * base.element_size()
        return t

    ids = torch.zeros(spec.micro_batch, spec.seq_len, dtype=torch.long, device=device)
    # as the training step calls it: the step's loss-token count given (no count reduction)
    items = torch.tensor(float(spec.micro_batch * (spec.seq_len - 1))).to(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids, num_items_in_batch=items).loss
    loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    micro_hlo = trace_hlo([loss] + [p.grad for p in trained])
    optimizer = make_optimizer(model, 1e-3, 0.0, device, zero1_mesh=mesh if spec.zero1 else None)
    norm = reduce_gradients(model, optimizer, mesh, spec.max_grad_norm, spec.zero1)
    optimizer.step()
    from ..parallel import comm

    mean_loss = comm.all_reduce(loss.detach().float().reshape(1), mesh.dp)
    step_hlo = trace_hlo([mean_loss, norm] + list(model.parameters()))
    torch_xla._XLAC._clear_pending_irs(str(device))
    micro = _comms(micro_hlo, rank)
    return Trace(
        dot_flops(micro_hlo),
        sum(saved.values()),
        tuple(micro),
        tuple(_minus(_comms(step_hlo, rank), micro)),
    )


def _child() -> None:
    """``python -m neuron_tp.plan.trace``: JSON {config, specs} on stdin, one JSON line per
    spec on stdout (a trace, or the error that refused the layout)."""
    from transformers import AutoConfig

    request = json.load(sys.stdin)
    cfg = dict(request["config"])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    for raw in request["specs"]:
        try:
            trace: Trace | str = trace_step(config, Spec(**raw))
        except (ValueError, NotImplementedError) as e:
            trace = str(e)
        print("TRACE " + json.dumps(to_json(trace)), flush=True)


def to_json(trace: Trace | str) -> dict:
    """``trace`` (or the message that refused its layout) as JSON-ready data."""
    return {"error": trace} if isinstance(trace, str) else {"ok": asdict(trace)}


def from_json(d: dict) -> Trace | str:
    """The inverse of :func:`to_json`."""
    if "error" in d:
        return d["error"]
    t = d["ok"]
    comms = {
        k: tuple(Comm(**{**c, "group": tuple(c["group"])}) for c in t[k]) for k in ("micro", "step")
    }
    return Trace(t["flops"], t["saved_bytes"], comms["micro"], comms["step"])


def run_trace_child(
    request: str, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """``python -m neuron_tp.plan.trace`` with ``request`` on stdin, its output captured as
    text (the launcher of :func:`trace_in_subprocess`; the test suite forks it from an
    interpreter that has the imports already)."""
    return subprocess.run(
        [sys.executable, "-m", "neuron_tp.plan.trace"],
        input=request,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def trace_in_subprocess(config, specs: list[Spec], timeout: float = 1800) -> list[Trace | str]:
    """Trace every spec in one child process on the XLA CPU device. Each result is a
    :class:`Trace` or the message of the error that refused the layout (e.g. tp not dividing
    the head count)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("CPU_NUM_DEVICES", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    request = {"config": config.to_dict(), "specs": [asdict(s) for s in specs]}
    out = run_trace_child(json.dumps(request), env, timeout)
    lines = [ln[6:] for ln in out.stdout.splitlines() if ln.startswith("TRACE ")]
    if out.returncode or len(lines) != len(specs):
        raise RuntimeError(f"tracing failed:\n{out.stderr[-3000:]}")
    return [from_json(json.loads(ln)) for ln in lines]


if __name__ == "__main__":
    _child()

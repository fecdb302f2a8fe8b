"""Pipeline training cases run on gloo ranks (test_pipeline_gloo.py) and on XLA CPU devices
(test_pipeline_xla.py), each against the unsharded transformers model trained with stock torch
(AdamW, clip_grad_norm_) on the same global batch: the step's loss on every rank, every
gradient after clipping (gathered over tp, in HF names, for the layers this stage holds), the
global norm, and the weights after the AdamW steps.

``_packed``: packed micro-batches (tests/helpers/packing_ref.py: several samples a row,
positions restarting per sample, padding), the reference running each sample on its own.
``_moe``: the tiny Mixtral of tests/helpers/moe_archs.py (6 experts, top-2, experts scaled
so they decide the logits) instead of Llama; ``_qwen2moe``: its Qwen2-MoE (shared expert with
its gate, layer 1 dense). ``_aux``: with the router load-balancing loss
(``output_router_logits``, coefficient :data:`AUX`), per micro-batch as at pp 1: the reference
adds transformers' ``aux_loss`` of each micro-batch times ``AUX / dp`` (each dp replica adds its
micro-batches' terms, the gradients are averaged over dp).
``_eval``: after training, :meth:`PipelineRunner.evaluate` (forward-only schedule) of the
micro-batches against the reference model's eval loss sum and label count.

A case name reads
``pp<p>[_tp<t>][_ep<e>][_cp<c>][_dp<d>][_sp][_tied][_v<v>][_zero1][_moe|_qwen2moe][_aux][_bw]
[_packed][_eval]``; ``_cp``: context parallelism inside the stages (ring attention over 2 x cp
chunks of each row, blocks of 2 tokens: several blocks per chunk); ``_bw``: blockwise attention
(blocks of 4), packed rows masked by segment ids instead of the 4D mask."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import threading

import torch
import transformers  # noqa: F401  (imported before XLA device threads start)

import neuron_tp as ntp
from moe_archs import MOE_ARCHS, loud_experts
from neuron_tp.hf import gather_hf_state_dict, parallelize
from neuron_tp.hf.attention import use_blockwise_attention
from neuron_tp.hf.context_parallel import context_parallel
from neuron_tp.optim.adamw import make_optimizer
from neuron_tp.optim.grads import reduce_gradients
from neuron_tp.parallel import comm
from neuron_tp.parallel.sharding import move_to
from neuron_tp.pipeline import schedule as schedules
from neuron_tp.pipeline.runner import PipelineRunner
from neuron_tp.pipeline.stages import plan_stages, split_model, sum_tied_grads
from packing_ref import LAYOUTS, S, packed_batch, samples
from tiny_configs import nd_config

LAYERS, BATCH, SEQ, LR, WD, MAX_NORM = 4, 2, 8, 1e-2, 0.1, 0.05
TOL = dict(atol=2e-5, rtol=2e-4)
AUX = 0.02  # the router load-balancing loss coefficient of the _aux cases
# _aux cases clip at a norm they never reach: the router terms' gradients (~1e-3) are then
# compared at full size, not scaled by MAX_NORM / norm to the tolerance's size.
AUX_MAX_NORM = 1e3
_lock = threading.Lock()


@functools.cache
def _barrier(world: int) -> threading.Barrier:
    return threading.Barrier(world)


def parse(case: str) -> dict:
    def get(key: str, default: int) -> int:
        found = re.search(rf"{key}(\d+)", case)
        return int(found.group(1)) if found else default

    return dict(
        pp=get("pp", 1),
        tp=get("tp", 1),
        ep=get("_ep", 1),
        cp=get("_cp", 1),
        blockwise="_bw" in case,
        v=get("_v", 1),
        sp="_sp" in case,
        tied="_tied" in case,
        zero1="_zero1" in case,
        m=get("_m", 4),
        packed="_packed" in case,
        eval="_eval" in case,
        aux="_aux" in case,
        max_norm=AUX_MAX_NORM if "_aux" in case else MAX_NORM,
        moe="qwen2_moe" if "_qwen2moe" in case else "mixtral" if "_moe" in case else None,
    )


_local = threading.local()  # XLA devices are threads of one process: one mesh per thread


def _mesh(tp: int, pp: int, ep: int = 1, cp: int = 1):
    meshes = _local.__dict__.setdefault("meshes", {})
    if (tp, pp, ep, cp) not in meshes:
        meshes[(tp, pp, ep, cp)] = ntp.init_mesh(tp=tp, pp=pp, ep=ep, cp=cp)
    ntp.set_default_mesh(meshes[(tp, pp, ep, cp)])
    return meshes[(tp, pp, ep, cp)]


def micro_batches(m: int, dp: int, seed: int = 0, packed: bool = False) -> list[list[dict]]:
    """``m`` micro-batches for each of ``dp`` replicas (``[dp][m]``), some labels ignored;
    ``packed``: packed rows of ``packing_ref`` (its layouts in turn)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r in range(dp):
        mine = []
        for i in range(m):
            if packed:
                k = r * m + i
                mine.append(packed_batch(list(LAYOUTS.values())[k % 3], 64, seed + k))
                continue
            ids = torch.randint(0, 64, (BATCH, SEQ), generator=gen)
            labels = ids.clone()
            labels[torch.rand(BATCH, SEQ, generator=gen) < 0.25] = -100
            mine.append({"input_ids": ids, "labels": labels})
        out.append(mine)
    return out


def _tokens(batches: list[list[dict]]) -> int:
    return int(sum((b["labels"][:, 1:] != -100).sum() for rep in batches for b in rep))


def reference(cfg: dict, steps: int) -> dict:
    """The unsharded model trained on the global batch: losses, norms, clipped grads and
    weights after ``steps`` AdamW steps (same batches every step)."""
    torch.manual_seed(0)
    model = _model(cfg)
    model.train()
    start = copy.deepcopy(model)
    batches = micro_batches(cfg["m"], cfg["dp"], packed=cfg["packed"])
    n = _tokens(batches)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR
    )
    out = {"loss": [], "norm": [], "grads": []}
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for b in _pieces(batches, cfg["packed"]):
            res = model(**b, num_items_in_batch=n)
            loss = res.loss
            if cfg["aux"]:  # each replica's micro-batches: AUX * aux, averaged over dp
                loss = loss - AUX * res.aux_loss * (1 - 1 / cfg["dp"])
            loss.backward()
            total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_norm"])
        out["norm"].append(float(norm))
        out["grads"].append({k: p.grad.clone() for k, p in model.named_parameters()})
        out["loss"].append(total)
        opt.step()
    out["weights"] = {k: p.detach().clone() for k, p in model.named_parameters()}
    with torch.no_grad():  # the trained model's eval totals on the same batches
        loss_sum = sum(
            float(model(**b, num_items_in_batch=1).loss) for b in _pieces(batches, cfg["packed"])
        )
    out["eval"] = [loss_sum, float(n)]
    return start, out


def _model(cfg: dict) -> torch.nn.Module:
    """The case's unsharded model (random weights from the current seed)."""
    if cfg["moe"]:
        aux = dict(output_router_logits=True, router_aux_loss_coef=AUX) if cfg["aux"] else {}
        config = MOE_ARCHS[cfg["moe"]](
            num_hidden_layers=LAYERS, vocab_size=64, tie_word_embeddings=cfg["tied"], **aux
        )
        return loud_experts(transformers.AutoModelForCausalLM.from_config(config).float(), 2.0)
    config = nd_config("llama", num_hidden_layers=LAYERS, tie_word_embeddings=cfg["tied"])
    return transformers.LlamaForCausalLM(config).float()


def _pieces(batches: list[list[dict]], packed: bool) -> list[dict]:
    """What the reference model runs: the micro-batches, or every packed sample alone."""
    flat = [b for rep in batches for b in rep]
    if not packed:
        return flat
    return [
        {"input_ids": ids[None], "labels": labels[None]} for b in flat for ids, labels in samples(b)
    ]


def _hf_name(name: str, tied: bool) -> str:
    return "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name


def run(
    case: str,
    device: str = "cpu",
    steps: int = 2,
    more_m: tuple = (),
    checkpoint_root: str | None = None,
) -> dict:
    """Train the case's pipeline for ``steps`` steps and compare with :func:`reference`; returns
    what was compared (names) and the numbers the tests report. ``more_m`` (XLA): one more
    step at each of these numbers of micro-batches; ``compiles`` after every step. With
    ``checkpoint_root``: the trained stages saved there and loaded back (:func:`_round_trip`)."""
    if device != "cpu":
        global torch_xla
        import torch_xla
    cfg = parse(case)
    mesh = _mesh(cfg["tp"], cfg["pp"], cfg["ep"], cfg["cp"])
    cfg["dp"] = mesh.dp_size
    with _lock:
        start, ref = reference(cfg, steps)
    model = copy.deepcopy(start)
    dev = torch.device(device) if device == "cpu" else ntp.xla_device()
    parallelize(model, mesh, sequence_parallel=cfg["sp"], parallel_loss=cfg["tp"] > 1)
    stage = split_model(model, mesh, plan_stages(LAYERS, cfg["pp"], cfg["v"]))
    context_parallel(stage.model, mesh, block=2)  # cp 1: unchanged
    if cfg["blockwise"]:  # packed rows by segment ids, no 4D mask
        use_blockwise_attention(stage.model, block=4)
    _check_ep(stage.model, cfg)
    move_to(stage.model, dev).train()
    opt = make_optimizer(stage.model, LR, WD, dev, zero1_mesh=mesh if cfg["zero1"] else None)
    name = "interleaved" if cfg["v"] > 1 else "1f1b"
    sched = schedules.build(name, cfg["pp"], cfg["m"], cfg["v"])
    seq = S if cfg["packed"] else SEQ
    runner = PipelineRunner(
        stage, sched, batch=BATCH, seq=seq, device=dev, sequence_parallel=cfg["sp"]
    )
    batches = micro_batches(cfg["m"], cfg["dp"], packed=cfg["packed"])
    scale = torch.tensor([mesh.dp_size / _tokens(batches)])
    checked, counts = [], []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = runner.step(batches[mesh.dp_rank], scale)
        sum_tied_grads(stage)
        runner.cut()
        norm = reduce_gradients(
            stage.model, opt, mesh, cfg["max_norm"], cfg["zero1"], pp_sum=runner.pp_sum
        )
        if cfg["zero1"]:
            _zero1_grads(opt)
        grads = gather_hf_state_dict(stage.model, mesh, grads=True)
        grads = {k: v.detach().clone() for k, v in grads.items()}
        opt.step()
        if device != "cpu":
            torch_xla.sync()
        loss = comm.all_reduce(loss, mesh.dp) / mesh.dp_size
        if device != "cpu":
            torch_xla.sync()
        torch.testing.assert_close(float(loss), ref["loss"][i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(float(norm), ref["norm"][i], atol=1e-5, rtol=1e-4)
        for k, g in grads.items():
            want = ref["grads"][i][_hf_name(k, cfg["tied"])]
            torch.testing.assert_close(g.cpu(), want, **TOL, msg=lambda m, k=k: f"grad {k}: {m}")
            checked.append(f"grad {k}")
        counts.append(_compiles(device))
    weights = gather_hf_state_dict(stage.model, mesh)
    tops = [max(float(t.abs().max()) for t in g.values()) for g in ref["grads"]]
    for k, w in weights.items():
        if k in ("model.rotary_emb.inv_freq",) or "rotary" in k:
            continue
        hf = _hf_name(k, cfg["tied"])
        noise = _noise(cfg, [g[hf] for g in ref["grads"]], tops)
        want = ref["weights"][hf]
        got = torch.where(noise, want, w.cpu())
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, k=k: f"weight {k}: {m}")
        near = (w.cpu() - want).abs() <= 2 * LR * steps  # AdamW moves by at most ~lr a step
        assert bool(near.all()), f"weight {k}: noise-gradient elements moved too far"
        checked.append(f"weight {k}")
    if cfg["eval"]:
        totals = comm.all_reduce(runner.evaluate(batches[mesh.dp_rank]), mesh.dp)
        if device != "cpu":
            torch_xla.sync()
        torch.testing.assert_close(totals.cpu().tolist(), ref["eval"], atol=1e-4, rtol=1e-5)
        checked.append("eval")
    if checkpoint_root is not None:
        checked += _round_trip(cfg, start, (stage, opt), ref["weights"], checkpoint_root)
    for m in more_m:  # the same step at other numbers of micro-batches: the same graphs
        more = schedules.build(name, cfg["pp"], m, cfg["v"])
        runner = PipelineRunner(
            stage, more, batch=BATCH, seq=SEQ, device=dev, sequence_parallel=cfg["sp"]
        )
        batches = micro_batches(m, cfg["dp"])
        opt.zero_grad(set_to_none=True)
        runner.step(batches[mesh.dp_rank], torch.tensor([mesh.dp_size / _tokens(batches)]))
        sum_tied_grads(stage)
        runner.cut()
        reduce_gradients(
            stage.model, opt, mesh, cfg["max_norm"], cfg["zero1"], pp_sum=runner.pp_sum
        )
        opt.step()
        torch_xla.sync()
        counts.append(_compiles(device))
    return {"checked": checked, "loss": ref["loss"], "ticks": len(sched.ticks), "compiles": counts}


def _check_ep(model: torch.nn.Module, cfg: dict) -> None:
    """Under ``_ep``: this rank holds ``1/ep`` of every MoE layer's experts."""
    if cfg["ep"] == 1:
        return
    experts = model.config.num_local_experts
    held = [p.shape[0] for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert held and all(h == experts // cfg["ep"] for h in held), (held, experts)


def _noise(cfg: dict, grads: list[torch.Tensor], tops: list[float]) -> torch.Tensor:
    """The elements whose (reference) gradient was float32 noise at some step: non-zero but
    below 1e-5 of the largest gradient of the whole model at that step (``tops``), the size of
    the rounding of the sums that make it (MoE cases only, else none). A gradient that is zero
    in exact arithmetic is such noise everywhere, e.g. a key projection's bias (softmax does not
    change when one constant is added to every score of a query). AdamW's first steps normalise
    such a gradient (say 2e-8 next to 5e-3) to a step of ~lr whose size the rounding decides, so
    these are held only within AdamW's step bound (exact zeros are held to ``TOL``)."""
    if not cfg["moe"]:
        return torch.zeros_like(grads[0], dtype=torch.bool)
    return functools.reduce(
        torch.logical_or, [(g != 0) & (g.abs() < 1e-5 * top) for g, top in zip(grads, tops)]
    )


def _round_trip(cfg: dict, start, trained: tuple, want: dict, root: str) -> list[str]:
    """Save the trained stages (each its own files), load the checkpoint into a fresh stage
    model and AdamW: the same weights and optimizer state; rank 0 consolidates it: the
    reference's weights under their HF names."""
    from safetensors.torch import load_file

    from neuron_tp import checkpoint

    stage, opt = trained
    mesh, dev = stage.mesh, next(stage.model.parameters()).device
    path = checkpoint.save(root, stage.model, opt, step=2, mesh=mesh)
    model = copy.deepcopy(start)
    parallelize(model, mesh, sequence_parallel=cfg["sp"], parallel_loss=cfg["tp"] > 1)
    fresh = split_model(model, mesh, plan_stages(LAYERS, cfg["pp"], cfg["v"]))
    move_to(fresh.model, dev)
    fresh_opt = make_optimizer(fresh.model, LR, WD, dev)
    checkpoint.load(path, fresh.model, fresh_opt, mesh=mesh, restore_rng=False)
    checked = []
    pairs = zip(stage.model.named_parameters(), fresh.model.named_parameters())
    for (name, p), (_, q) in pairs:
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), f"loaded {name}"
        for key, v in opt.state[p].items():
            got = fresh_opt.state[q][key]
            assert torch.equal(v.cpu(), got.cpu()), f"loaded optimizer {name} {key}"
        checked.append(f"loaded {name}")
    if mesh.rank == 0:
        hf = load_file(checkpoint.consolidate(path, f"{root}-hf") + "/model.safetensors")
        assert sorted(hf) == sorted(k for k in want if "rotary" not in k), sorted(hf)
        for k, w in hf.items():
            torch.testing.assert_close(w, want[k], **TOL, msg=lambda m, k=k: f"consolidated {k}")
            checked.append(f"consolidated {k}")
    return checked


def _zero1_grads(opt) -> None:
    """ZeRO-1 keeps the dp-mean, clipped gradient as chunks of the shards' gradients: put the
    whole (tp-sharded) gradient, gathered over dp, in each parameter's ``.grad`` to compare."""
    for s in opt.slots.values():
        full = comm.all_gather(s.shard.grad.detach(), s.group, 0)
        s.param.grad = full[: s.param.numel()].view(s.param.shape).to(s.param.dtype)


def _compiles(device: str) -> int:
    """Compiles so far in this process, read when every rank got here (XLA device threads)."""
    if device == "cpu":
        return 0
    import torch_xla.runtime as xr

    from neuron_tp.backend.graphs import graph_counters

    barrier = _barrier(xr.world_size())
    barrier.wait(timeout=600)
    count = graph_counters()["compiles"]
    barrier.wait(timeout=600)
    return count


class _Recorder:
    """A safetensors file that counts the elements read from it (``log``: name -> elements)."""

    def __init__(self, f, log: dict):
        self._f, self._log = f, log

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_tensor(self, name: str):
        t = self._f.get_tensor(name)
        self._log[name] = self._log.get(name, 0) + t.numel()
        return t

    def get_slice(self, name: str):
        return _SliceRecorder(self._f.get_slice(name), name, self._log)


class _SliceRecorder:
    def __init__(self, sl, name: str, log: dict):
        self._sl, self._name, self._log = sl, name, log

    def get_shape(self):
        return self._sl.get_shape()

    def __getitem__(self, key):
        t = self._sl[key]
        self._log[self._name] = self._log.get(self._name, 0) + t.numel()
        return t


@contextlib.contextmanager
def _shared_dir(mesh):
    """A HF directory of tiny-llama-4l that rank 0 writes for every (gloo) rank."""
    import shutil
    import tempfile

    import torch.distributed as dist

    from neuron_tp.job.presets import build_model

    path = os.path.join(tempfile.gettempdir(), f"ntp-pp-load-{os.getppid()}")
    if mesh.rank == 0:
        build_model("tiny-llama-4l", 257, seed=3).save_pretrained(path)
    dist.barrier()
    try:
        yield path
    finally:
        dist.barrier()
        if mesh.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def load_stage(case: str) -> dict:
    """A stage loaded from a HF directory (``neuron_tp.from_pretrained(..., cut=)``, the path
    ``train --pp`` takes for a local model): nothing is materialised before the cut, only the
    stage's tensors are read (elements counted at the files), its parameters are those of the
    whole model loaded then cut, and their bytes about 1/pp of the model's."""
    from neuron_tp.hf import model_files

    cfg = parse(case)
    mesh = _mesh(cfg["tp"], cfg["pp"])
    plan = plan_stages(LAYERS, cfg["pp"])
    with _shared_dir(mesh) as path:
        at_cut, stages, log = [], [], {}

        def cut(model):
            at_cut.append(sum(not p.is_meta for p in model.parameters()))
            stages.append(split_model(model, mesh, plan))

        original = model_files.open_safetensors
        model_files.open_safetensors = lambda file: _Recorder(original(file), log)
        try:
            mine = ntp.from_pretrained(path, mesh, cut=cut)
        finally:
            model_files.open_safetensors = original
        whole = ntp.from_pretrained(path, mesh)
    total = sum(p.numel() for p in whole.parameters())  # this tp rank's shards
    table, norm = whole.model.embed_tokens.weight.numel(), whole.model.norm.weight.numel()
    theirs = dict(split_model(whole, mesh, plan).model.named_parameters())
    got = dict(mine.named_parameters())
    assert at_cut == [0] and stages[0].model is mine, at_cut
    assert set(got) == set(theirs), set(got) ^ set(theirs)
    for k, p in got.items():
        assert torch.equal(p, theirs[k]), k
    held = sum(p.numel() for p in got.values())
    ends = table + (norm if mesh.pp.rank == cfg["pp"] - 1 else 0)  # embedding / norm + head
    assert held - ends == (total - table - norm) / cfg["pp"], (held, total)  # layers / pp
    read = sum(log.values())  # the stage's shards (the vocabulary's zero padding is not read)
    assert held - table < read <= held, (read, held)
    return {"held": held, "total": total, "read": read}

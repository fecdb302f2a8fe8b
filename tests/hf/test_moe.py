"""MoE families under tensor parallelism vs the unsharded transformers model, on gloo ranks
(tp 2 and 4, one launch per tp): logits, loss (with and without the router auxiliary loss),
every gathered gradient on every rank (the replicated router's included), the global gradient
norm (clipping), logits after one optimizer step, with and without sequence parallelism;
training jitter; the gather (decode) mode and greedy generation; the number of collectives of
one MoE layer; checkpoints both ways (and as transformers writes them)."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from moe_archs import MOE_ARCHS, V, build_moe  # noqa: E402
from neuron_tp.hf import (  # noqa: E402
    from_pretrained,
    full_logits,
    gather_hf_state_dict,
    parallelize,
    save_pretrained,
)
from neuron_tp.moe import ParallelMoEBlock, set_moe_mode  # noqa: E402

ATOL = 2e-5


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def _ids(seed: int = 123, shape=(2, 8)) -> torch.Tensor:
    return torch.randint(1, V, shape, generator=torch.Generator().manual_seed(seed))


def _check(ref, tag: str, sp: bool, mode: str | None = None) -> None:
    """Eval logits; train-mode loss (+ aux loss), every gradient, logits after one SGD step."""
    ids = _ids()
    m = parallelize(copy.deepcopy(ref), sequence_parallel=sp)
    if mode:
        set_moe_mode(m, mode)
    assert any(isinstance(x, ParallelMoEBlock) for x in m.modules()), tag
    _close(m(ids).logits, ref(ids).logits, f"{tag} logits")
    ref = copy.deepcopy(ref).train()
    m = parallelize(copy.deepcopy(ref), sequence_parallel=sp, parallel_loss=True)
    if mode:
        set_moe_mode(m, mode)
    out, want = m(ids, labels=ids), ref(ids, labels=ids)
    _close(out.loss, want.loss, f"{tag} loss")
    if want.aux_loss is not None:
        _close(out.aux_loss, want.aux_loss, f"{tag} aux_loss")
    want.loss.backward()
    out.loss.backward()
    ntp.sync_sequence_parallel_grads(m)
    grads = gather_hf_state_dict(m, grads=True)
    expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(grads) == set(expected), f"{tag}: gradient names differ {set(grads) ^ set(expected)}"
    for n, g in expected.items():
        _close(grads[n], g, f"{tag} grad {n}")
    want_norm = torch.stack([g.pow(2).sum() for g in expected.values()]).sum().sqrt()
    _close(ntp.global_grad_norm(m), want_norm, f"{tag} global grad norm")
    for model in (m, ref):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    m.eval(), ref.eval()
    with full_logits(m):
        _close(m(ids).logits, ref(ids).logits, f"{tag} logits after a step")


def _family(case: str, tp: int) -> None:
    name, sp = case.removesuffix("-sp"), case.endswith("-sp")
    _check(build_moe(name), f"{name} tp={tp} sp={sp}", sp)


def _aux(tp: int) -> None:
    """The router auxiliary (load-balancing) loss, in the loss too, without and with SP."""
    for name in ("mixtral", "qwen2_moe"):
        ref = build_moe(name, output_router_logits=True, router_aux_loss_coef=0.05)
        for sp in (False, True):
            _check(ref, f"{name} aux tp={tp} sp={sp}", sp)
    # A packed row's 4-D mask (one sample per row here: the plain causal attention), which
    # transformers' aux loss cannot read: every position counts, as with no mask.
    from neuron_tp.hf.packing import block_causal_mask

    ref = build_moe("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.05).train()
    m = parallelize(copy.deepcopy(ref), parallel_loss=True)
    ids = _ids()
    mask = block_causal_mask(torch.ones_like(ids))
    out, want = m(ids, attention_mask=mask, labels=ids), ref(ids, labels=ids)
    _close(out.aux_loss, want.aux_loss, f"4-D mask aux tp={tp}")
    _close(out.loss, want.loss, f"4-D mask loss tp={tp}")
    out.loss.backward()
    want.loss.backward()
    ntp.sync_sequence_parallel_grads(m)  # Qwen3's per-head q/k norms
    grads = gather_hf_state_dict(m, grads=True)
    for n, p in ref.named_parameters():
        _close(grads[n], p.grad, f"4-D mask tp={tp} grad {n}")


def _jitter(tp: int) -> None:
    """Mixtral's training input jitter: every tp rank uses tp rank 0's draw (ranks seeded
    differently here), so the sharded model equals transformers run with rank 0's seed (loss
    and gradients); in eval there is none."""
    rank = torch.distributed.get_rank()
    ref = build_moe("mixtral", router_jitter_noise=0.3).train()
    with torch.no_grad():  # experts that matter next to the residual stream
        for layer in ref.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(10)
            layer.mlp.experts.down_proj.mul_(10)
    m = parallelize(copy.deepcopy(ref), parallel_loss=True)
    ids = _ids()
    torch.manual_seed(1001)
    other = ref(ids, labels=ids).loss  # another draw
    torch.manual_seed(1000)
    want = ref(ids, labels=ids).loss
    torch.manual_seed(1000 + rank)
    got = m(ids, labels=ids).loss
    _close(got, want, f"jitter tp={tp} loss")
    want.backward()
    got.backward()
    grads = gather_hf_state_dict(m, grads=True)
    for n, p in ref.named_parameters():
        _close(grads[n], p.grad, f"jitter tp={tp} grad {n}")
    m.eval(), ref.eval()
    plain = ref(ids, labels=ids).loss  # eval: no jitter
    for loss in (plain, other):
        assert (loss - want).abs() > 1e-3, f"jitter changes too little: {loss} vs {want}"
    with full_logits(m):
        _close(m(ids).logits, ref(ids).logits, f"jitter tp={tp} eval logits")


def _gather_mode(tp: int) -> None:
    """Every token through the gather path (decode's), then greedy generation in auto mode
    (the prompt is dense, every decode step T*k < E: gather)."""
    for name in ("qwen2_moe", "glm4_moe"):
        _check(build_moe(name), f"{name} gather tp={tp}", False, mode="gather")
    ref = build_moe("mixtral")
    m = parallelize(copy.deepcopy(ref))
    ids = _ids(7, (1, 5))
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    got = m.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.equal(got, want), (got, want)


def _collectives(tp: int) -> None:
    """One Mixtral MoE layer: forward = ONE all-reduce (SP: one all-gather + one
    reduce-scatter), whatever the number of experts; backward = two all-reduces (input, routing
    weights; SP: one reduce-scatter + one all-reduce)."""
    from neuron_tp.parallel import comm

    ref = build_moe("mixtral", num_hidden_layers=1)
    for sp in (False, True):
        m = parallelize(copy.deepcopy(ref), sequence_parallel=sp)
        block = m.model.layers[0].mlp
        calls: list[str] = []
        originals = {n: getattr(comm, n) for n in ("all_reduce", "all_gather", "reduce_scatter")}

        def counting(n, f):
            return lambda *a, **k: (calls.append(n), f(*a, **k))[1]

        try:
            for n, f in originals.items():
                setattr(comm, n, counting(n, f))
            x = torch.randn(2, 8 // tp if sp else 8, 32, requires_grad=True)
            y = block(x)
            fwd, calls[:] = list(calls), []
            y.sum().backward()
            bwd = list(calls)
        finally:
            for n, f in originals.items():
                setattr(comm, n, f)
        if sp:
            assert sorted(fwd) == ["all_gather", "reduce_scatter"], fwd
            assert sorted(bwd) == ["all_gather", "all_reduce", "reduce_scatter"], bwd
        else:
            assert fwd == ["all_reduce"], fwd
            assert bwd == ["all_reduce", "all_reduce"], bwd


def _checkpoints(tmp: str, tp: int) -> None:
    """save_pretrained -> plain transformers loads it equal; from_pretrained (each rank reads
    its slices of the 3-D expert tensors, or of each expert's tensors as transformers saves
    them) equals parallelize of the full model."""
    import transformers as tf

    rank = torch.distributed.get_rank()
    for name in ("qwen2_moe", "glm4_moe"):
        ref = build_moe(name)
        out = os.path.join(tmp, f"{name}-tp{tp}")
        save_pretrained(parallelize(copy.deepcopy(ref)), out)
        back = tf.AutoModelForCausalLM.from_pretrained(out).eval()
        for n, t in ref.state_dict().items():
            assert torch.equal(back.state_dict()[n], t), f"{name} save: {n}"
        loaded = from_pretrained(out)
        expected = parallelize(copy.deepcopy(ref))
        for (n, p), (n2, q) in zip(loaded.state_dict().items(), expected.state_dict().items()):
            assert n == n2 and torch.equal(p, q), f"{name} from_pretrained: {n} (rank {rank})"
        ids = _ids(5)
        _close(loaded(ids).logits, ref(ids).logits, f"{name} from_pretrained logits")
    # What transformers itself writes (and the Hub holds): one tensor per expert, Mixtral's
    # under block_sparse_moe.experts.{e}.w1/w2/w3; each rank reads its slices of each.
    from neuron_tp.hf.model_files import checkpoint_files

    for name, key in (
        ("mixtral", "model.layers.0.block_sparse_moe.experts.5.w3.weight"),
        ("qwen2_moe", "model.layers.0.mlp.experts.5.up_proj.weight"),
    ):
        ref = build_moe(name)
        out = os.path.join(tmp, f"{name}-hf-tp{tp}")
        if rank == 0:
            copy.deepcopy(ref).save_pretrained(out)  # saving sets config fields on rank 0 only
        torch.distributed.barrier()
        assert key in checkpoint_files(out), sorted(checkpoint_files(out))[:8]
        loaded, expected = from_pretrained(out), parallelize(copy.deepcopy(ref))
        for (n, p), (n2, q) in zip(loaded.state_dict().items(), expected.state_dict().items()):
            assert n == n2 and torch.equal(p, q), f"{name} per-expert files: {n} (rank {rank})"


CASES = [n + sp for n in MOE_ARCHS for sp in ("", "-sp")] + [
    "aux",
    "jitter",
    "gather",
    "collectives",
    "checkpoints",
]


def _case(case: str, tp: int, tmp: str) -> None:
    gloo_dist.shared_mesh(tp)
    if case == "aux":
        _aux(tp)
    elif case == "jitter":
        _jitter(tp)
    elif case == "gather":
        _gather_mode(tp)
    elif case == "collectives":
        _collectives(tp)
    elif case == "checkpoints":
        _checkpoints(tmp, tp)
    else:
        _family(case, tp)


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe"))


# tp 4: every family without SP and SP once (SP is proven per family at tp 2: it gathers the
# sequence before the router, whatever the tp degree)
CASES_TP4 = [c for c in CASES if not c.endswith("-sp")] + ["mixtral-sp"]


@pytest.mark.parametrize(
    "tp, case",
    [(2, case) for case in CASES] + [(4, case) for case in CASES_TP4],
    ids=lambda v: f"tp{v}" if isinstance(v, int) else v,
)
def test_moe(tp, case, shared_tmp):
    cases = CASES if tp == 2 else CASES_TP4
    gloo_dist.run_case(_case, case, tp, shared_tmp, cases=cases, world_size=tp, timeout=600)

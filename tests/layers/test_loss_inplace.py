"""The in-place vocab-parallel cross-entropy: the caller's logits stay untouched, a second
backward through the graph fails loudly, and the result still matches F.cross_entropy (label
smoothing over the full vocabulary, ignore_index, padded last shard, large logits)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import gloo_dist
import neuron_tp as ntp
from reference import assert_close

B, S = 3, 5
PAD_VALUE = 1e4  # garbage in padded columns: would dominate the loss if not masked


def _shard(full: torch.Tensor, tp, V: int) -> torch.Tensor:
    """This rank's slice of ``full`` [..., V], the last shard padded with ``PAD_VALUE``."""
    per_rank = -(-V // tp.size)
    padded = F.pad(full, (0, per_rank * tp.size - V), value=PAD_VALUE)
    return padded.chunk(tp.size, -1)[tp.rank].clone()


def _check_reference(mesh, V, dtype, smoothing, reduction, ignore_index, scale=1.0):
    """Loss and dlogits against the unsharded F.cross_entropy; logits left as they were."""
    tp = mesh.tp
    torch.manual_seed(11)
    full = (torch.randn(B, S, V) * scale).to(dtype)
    labels = torch.randint(0, V, (B, S))
    labels[0, 1] = ignore_index
    labels[1, 2] = V - 1  # a label in the (padded) last shard
    labels[2, 0] = 0
    ref_in = full.float().clone().requires_grad_(True)
    ref = F.cross_entropy(
        ref_in.flatten(0, 1),
        labels.flatten(),
        ignore_index=ignore_index,
        label_smoothing=smoothing,
        reduction=reduction,
    ).view(labels.shape if reduction == "none" else ())
    g = torch.randn_like(ref)
    (ref * g).sum().backward()

    w = _shard(full, tp, V).requires_grad_(True)
    logits = w * 1  # a non-leaf, like an lm_head output
    before, version = logits.detach().clone(), logits._version
    loss = ntp.parallel_cross_entropy(
        logits,
        labels,
        mesh=mesh,
        vocab_size=V,
        ignore_index=ignore_index,
        label_smoothing=smoothing,
        reduction=reduction,
    )
    what = f"V={V} {dtype} smoothing={smoothing} {reduction} ignore={ignore_index} x{scale}"
    assert_close(loss, ref.detach(), f"loss {what}", atol=1e-5 * scale, rtol=1e-5)
    (loss * g).sum().backward()
    assert w.grad.dtype == dtype
    expected = _shard(ref_in.grad, tp, V)
    expected[..., (torch.arange(expected.shape[-1]) + tp.rank * expected.shape[-1]) >= V] = 0
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-2)
    assert_close(w.grad.float(), expected, f"dlogits {what}", **tol)
    assert logits._version == version, f"logits modified in place ({what})"
    assert torch.equal(logits.detach(), before), f"logits values changed ({what})"


def _check_unchanged(mesh, dtype):
    """Forward + backward leave the caller's (leaf) logits and their version as they were."""
    tp = mesh.tp
    torch.manual_seed(12)
    V = 8 * tp.size
    logits = torch.randn(B, S, V // tp.size).to(dtype).requires_grad_(True)
    before, version = logits.detach().clone(), logits._version
    labels = torch.randint(0, V, (B, S))
    ntp.parallel_cross_entropy(logits, labels, mesh=mesh, label_smoothing=0.1).backward()
    assert logits._version == version, f"{dtype} logits modified in place"
    assert torch.equal(logits.detach(), before), f"{dtype} logits values changed"
    assert logits.grad is not None and logits.grad.dtype == dtype


def _check_retain_graph(mesh, dtype):
    """The backward consumes what the forward saved: a second backward must raise, not
    silently return a wrong gradient."""
    tp = mesh.tp
    torch.manual_seed(13)
    V = 8 * tp.size - 1  # padded
    logits = torch.randn(B, S, -(-V // tp.size)).to(dtype).requires_grad_(True)
    labels = torch.randint(0, V, (B, S))
    loss = ntp.parallel_cross_entropy(logits, labels, mesh=mesh, vocab_size=V)
    loss.backward(retain_graph=True)
    first = logits.grad.clone()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert torch.equal(logits.grad, first), "a failed second backward changed the gradient"


REFERENCE_CASES = {
    f"reference-V{V}-{str(dt)[6:]}-s{s}-{r}-ignore{ii}" + (f"-x{sc}" if sc != 1 else ""): (
        lambda mesh, V=V, dt=dt, s=s, r=r, ii=ii, sc=sc: _check_reference(mesh, V, dt, s, r, ii, sc)
    )
    for V, dt, s, r, ii, sc in [
        *itertools.product([12, 13], [torch.float32], [0.0, 0.1], ["mean", "none"], [-100], [1]),
        (13, torch.float32, 0.2, "sum", 4, 1),  # an ignored id inside the vocab
        (13, torch.float32, 0.1, "mean", -100, 40),  # shards far apart: rescaling matters
        (12, torch.float32, 0.1, "mean", -100, 40),
        (13, torch.bfloat16, 0.1, "mean", -100, 1),
        (12, torch.bfloat16, 0.0, "none", 3, 1),
    ]
}
CASES = {
    **REFERENCE_CASES,
    "unchanged-fp32": lambda mesh: _check_unchanged(mesh, torch.float32),
    "unchanged-bf16": lambda mesh: _check_unchanged(mesh, torch.bfloat16),
    "retain_graph-fp32": lambda mesh: _check_retain_graph(mesh, torch.float32),
    "retain_graph-bf16": lambda mesh: _check_retain_graph(mesh, torch.bfloat16),
}


def _case(case: str, tp: int) -> None:
    CASES[case](gloo_dist.shared_mesh(tp))


@pytest.mark.parametrize(
    "tp, case",
    [(tp, c) for tp in (2, 3) for c in CASES],
    ids=[f"tp{tp}-{c}" for tp in (2, 3) for c in CASES],
)
def test_gloo(tp, case):
    """Every case of one tp in one gloo launch, one test ID each."""
    gloo_dist.run_case(_case, case, tp, cases=list(CASES), world_size=tp)


@pytest.mark.parametrize("case", list(CASES))
def test_tp1(case):
    """The same cases on one CPU process (a tp=1 mesh: no collective)."""
    CASES[case](ntp.Mesh(1, 0))

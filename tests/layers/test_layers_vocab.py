"""Vocab-parallel embedding and cross-entropy against nn.Embedding / F.cross_entropy."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gloo_dist
import neuron_tp as ntp
from reference import assert_close, full_param_and_grad

V, H, B, S = 11, 5, 2, 4  # 11 is divisible by neither 2 nor 4: the last shard is padded


def _embedding(mesh, sp, padding_idx):
    torch.manual_seed(3)
    ref = nn.Embedding(V, H, padding_idx=padding_idx)
    emb = ntp.VocabParallelEmbedding.from_embedding(ref, sequence_parallel=sp)
    ids = torch.randint(0, V, (B, S))
    ids[0, 0] = padding_idx if padding_idx is not None else 0
    ids[1, -1] = V - 1
    y_ref = ref(ids)
    gy = torch.randn_like(y_ref)
    (y_ref * gy).sum().backward()
    y = emb(ids)
    tp = mesh.tp
    if sp:
        y_ref, gy = y_ref.chunk(tp.size, 1)[tp.rank], gy.chunk(tp.size, 1)[tp.rank]
    assert_close(y, y_ref.detach(), f"embedding sp={sp}")
    y.backward(gy)
    full, g = full_param_and_grad(emb, "weight", mesh)
    assert_close(full, ref.weight.detach(), "embedding weight")
    assert_close(g, ref.weight.grad, f"embedding dW sp={sp} padding_idx={padding_idx}")


def _cross_entropy(mesh, smoothing, reduction):
    tp = mesh.tp
    torch.manual_seed(4)
    logits_full = torch.randn(B, S, V, requires_grad=True)
    labels = torch.randint(0, V, (B, S))
    labels[0, 1] = -100
    labels[1, 2] = V - 1  # a label in the padded shard
    ref = F.cross_entropy(
        logits_full.flatten(0, 1),
        labels.flatten(),
        ignore_index=-100,
        label_smoothing=smoothing,
        reduction=reduction,
    ).view(labels.shape if reduction == "none" else ())
    g = torch.randn_like(ref)
    (ref * g).sum().backward()
    per_rank = -(-V // tp.size)
    padded = F.pad(logits_full.detach(), (0, per_rank * tp.size - V), value=123.0)
    local = padded.chunk(tp.size, -1)[tp.rank].clone().requires_grad_(True)
    loss = ntp.parallel_cross_entropy(
        local, labels, vocab_size=V, label_smoothing=smoothing, reduction=reduction
    )
    assert_close(loss, ref.detach(), f"loss smoothing={smoothing} {reduction}")
    (loss * g).sum().backward()
    grad_full = F.pad(logits_full.grad, (0, per_rank * tp.size - V))
    assert_close(
        local.grad,
        grad_full.chunk(tp.size, -1)[tp.rank],
        f"dlogits smoothing={smoothing} {reduction}",
    )


def _lm_head_padded(mesh):
    """A vocab lm_head tp does not divide: padded shards, trimmed gathered output."""
    torch.manual_seed(5)
    ref = nn.Linear(H, V, bias=False)
    head = ntp.ColumnParallelLinear.from_linear(ref, pad_output=True, gather_output=True)
    x = torch.randn(B, S, H)
    assert_close(head(x), ref(x).detach(), "padded lm_head")
    local_head = ntp.ColumnParallelLinear.from_linear(ref, pad_output=True)
    labels = torch.randint(0, V, (B, S))
    loss = ntp.parallel_cross_entropy(local_head(x), labels, vocab_size=V)
    assert_close(
        loss,
        F.cross_entropy(ref(x).flatten(0, 1), labels.flatten()).detach(),
        "loss from padded lm_head",
    )


# case name -> check(mesh)
VOCAB_CASES = {
    **{
        "embedding"
        + ("-sp" if sp else "")
        + (f"-padding_idx{pad}" if pad is not None else ""): lambda mesh, s=sp, p=pad: _embedding(
            mesh, s, p
        )
        for sp, pad in itertools.product([False, True], [None, 2])
    },
    **{
        f"cross_entropy-smoothing{smoothing}-{reduction}": lambda mesh, s=smoothing, r=reduction: (
            _cross_entropy(mesh, s, r)
        )
        for smoothing, reduction in itertools.product([0.0, 0.1], ["mean", "sum", "none"])
    },
    "lm_head_padded": _lm_head_padded,
}


def _vocab_case(case: str, tp: int) -> None:
    VOCAB_CASES[case](gloo_dist.shared_mesh(tp))


@pytest.mark.parametrize(
    "tp, case",
    [(tp, c) for tp in (2, 4) for c in VOCAB_CASES],
    ids=[f"tp{tp}-{c}" for tp in (2, 4) for c in VOCAB_CASES],
)
def test_vocab(tp, case):
    """Every case of one tp in one launch (see gloo_dist.run_case), one test ID each."""
    gloo_dist.run_case(_vocab_case, case, tp, cases=list(VOCAB_CASES), world_size=tp)

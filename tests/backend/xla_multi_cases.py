"""Cases run on N XLA CPU devices by tests/backend/test_xla_multi.py (one thread per device, see
xla_dist.py): every region function, column/row-parallel linears, the vocab-parallel embedding
and cross-entropy, each against the unsharded computation in plain torch on the CPU (outputs,
input grads and every gathered param grad). Data differ between dp groups, so a collective
that mixed them would show.

Each group of cases (regions, linears, vocab) traces forward + backward + the gathers of all its
cases, then ``torch_xla.sync()`` once (one graph, compiled once per device: compiles dominate
the run time) and compares on the CPU. The CPU references use the global RNG, shared by the threads:
they are built inside ``xla_dist.serial()``.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_xla
from torch import nn

import neuron_tp as ntp
from neuron_tp.backend.hlo import parse_collectives, trace_hlo
from neuron_tp.parallel import comm, regions
from reference import assert_close
from xla_dist import serial

B, S, V, H = 2, 8, 11, 5  # S divisible by tp 2 and 4; vocab 11 divisible by neither


class Checks:
    """Pairs (what, XLA tensor, CPU expectation) compared after one sync."""

    def __init__(self, mesh):
        self.mesh, self.pending, self.count = mesh, [], 0

    def add(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.pending.append((f"{what} [{self.mesh}]", got, want.detach()))

    def flush(self) -> None:
        torch_xla.sync()  # one graph: forward, backward, gathers of the pending cases
        for what, got, want in self.pending:
            assert_close(got.cpu(), want, what)
        self.count += len(self.pending)
        self.pending = []


def _dev(t: torch.Tensor, grad: bool = False) -> torch.Tensor:
    out = t.detach().to(torch_xla.device())
    return out.requires_grad_(True) if grad else out


def _per_rank(world, shape, seed):
    """Every rank's input, known to every rank (independent reference data)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(world)]


def _data_gen(seed: int, mesh) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * seed + mesh.dp_rank)  # differs per dp group


def regions_case(c: Checks) -> None:
    mesh = c.mesh
    grp, r, tp = mesh.tp, mesh.tp_rank, mesh.tp_size
    base = mesh.dp_rank * tp
    xs = _per_rank(mesh.world_size, (2, 4, 6), seed=7)[base : base + tp]
    gs = _per_rank(mesh.world_size, (2, 4, 6), seed=8)[base : base + tp]
    g_full = _per_rank(mesh.world_size, (2, 4 * tp, 6), seed=9)[base : base + tp]
    x_full = _per_rank(mesh.world_size, (2, 4 * tp, 6), seed=10)[base : base + tp]
    cat_g, full = torch.cat(gs, 1), torch.cat(xs, 1)

    def run(what, fn, x, g_out, want_y, want_gx):
        x = _dev(x, grad=True)
        y = fn(x)
        y.backward(_dev(g_out))
        c.add(f"{what} fwd", y, want_y)
        c.add(f"{what} bwd", x.grad, want_gx)

    run("copy", lambda t: regions.identity_fwd_all_reduce_bwd(t, grp), xs[r], gs[r], xs[r], sum(gs))
    run(
        "reduce",
        lambda t: regions.all_reduce_fwd_identity_bwd(t, grp),
        xs[r],
        gs[r],
        sum(xs),
        gs[r],
    )
    run(
        "reduce, then in place",
        lambda t: regions.all_reduce_fwd_identity_bwd(t, grp).add_(1),
        xs[r],
        gs[r],
        sum(xs) + 1,
        gs[r],
    )  # Falcon's `mlp_output += attention_output`
    run(
        "all_reduce_fwd_all_reduce_bwd",
        lambda t: regions.all_reduce_fwd_all_reduce_bwd(t, grp),
        xs[r],
        gs[r],
        sum(xs),
        sum(gs),
    )
    run(
        "scatter seq",
        lambda t: regions.split_fwd_all_gather_bwd(t, grp, 1),
        full,
        gs[r],
        xs[r],
        cat_g,
    )
    run(
        "scatter last",
        lambda t: regions.split_fwd_all_gather_bwd(t, grp, -1),
        torch.cat(xs, -1),
        gs[r],
        xs[r],
        torch.cat(gs, -1),
    )
    run(
        "gather",
        lambda t: regions.all_gather_fwd_split_bwd(t, grp, 1),
        xs[r],
        cat_g,
        full,
        gs[r],
    )
    run(
        "sp gather",
        lambda t: regions.all_gather_fwd_reduce_scatter_bwd(t, grp, 1),
        xs[r],
        g_full[r],
        full,
        sum(g_full).chunk(tp, 1)[r],
    )
    run(
        "reduce-scatter",
        lambda t: regions.reduce_scatter_fwd_all_gather_bwd(t, grp, 1),
        x_full[r],
        gs[r],
        sum(x_full).chunk(tp, 1)[r],
        cat_g,
    )
    c.flush()


def _check_params(c: Checks, layer, ref, what: str) -> None:
    params = ntp.gather_params(layer, c.mesh)
    grads = ntp.gather_params(layer, c.mesh, grads=True)
    assert set(params) == {n for n, _ in ref.named_parameters()}, what
    for name, full in params.items():
        c.add(f"{what} {name}", full, getattr(ref, name))
        c.add(f"{what} d{name}", grads[name], getattr(ref, name).grad)


def column_case(c: Checks, in_f, out_f, bias, sp, gather, seed=11) -> None:
    tp, r = c.mesh.tp_size, c.mesh.tp_rank
    with serial():
        torch.manual_seed(seed)
        ref = nn.Linear(in_f, out_f, bias=bias)
        layer = ntp.ColumnParallelLinear.from_linear(
            ref, sequence_parallel=sp, gather_output=gather, mesh=c.mesh
        )
    gen = _data_gen(seed, c.mesh)
    x_full = torch.randn(B, S, in_f, generator=gen, requires_grad=True)
    y_ref = ref(x_full)
    gy = torch.randn(y_ref.shape, generator=gen)
    (y_ref * gy).sum().backward()
    layer.to(torch_xla.device())
    x = _dev(x_full.chunk(tp, 1)[r] if sp else x_full, grad=True)
    y = layer(x)
    y.backward(_dev(gy if gather else gy.chunk(tp, -1)[r]))
    what = f"column {in_f}->{out_f} bias={bias} sp={sp} gather={gather}"
    c.add(f"{what} out", y, y_ref if gather else y_ref.chunk(tp, -1)[r])
    c.add(f"{what} dX", x.grad, x_full.grad.chunk(tp, 1)[r] if sp else x_full.grad)
    _check_params(c, layer, ref, what)


def row_case(c: Checks, in_f, out_f, bias, sp, parallel_in, seed=12) -> None:
    tp, r = c.mesh.tp_size, c.mesh.tp_rank
    with serial():
        torch.manual_seed(seed)
        ref = nn.Linear(in_f, out_f, bias=bias)
        layer = ntp.RowParallelLinear.from_linear(
            ref, sequence_parallel=sp, mesh=c.mesh, input_is_parallel=parallel_in
        )
    gen = _data_gen(seed, c.mesh)
    x_full = torch.randn(B, S, in_f, generator=gen, requires_grad=True)
    y_ref = ref(x_full)
    gy = torch.randn(y_ref.shape, generator=gen)
    (y_ref * gy).sum().backward()
    layer.to(torch_xla.device())
    x = _dev(x_full.chunk(tp, -1)[r] if parallel_in else x_full, grad=True)
    y = layer(x)
    y.backward(_dev(gy.chunk(tp, 1)[r] if sp else gy))
    if sp:
        ntp.sync_sequence_parallel_grads(layer, c.mesh)
    what = f"row {in_f}->{out_f} bias={bias} sp={sp} parallel_in={parallel_in}"
    c.add(f"{what} out", y, y_ref.chunk(tp, 1)[r] if sp else y_ref)
    c.add(f"{what} dX", x.grad, x_full.grad.chunk(tp, -1)[r] if parallel_in else x_full.grad)
    _check_params(c, layer, ref, what)


def skip_bias_and_packed_case(c: Checks) -> None:
    tp, r, dev = c.mesh.tp_size, c.mesh.tp_rank, torch_xla.device()
    with serial():
        torch.manual_seed(0)
        ref = nn.Linear(7, 2 * tp)
        skip = ntp.ColumnParallelLinear.from_linear(
            ref, skip_bias_add=True, gather_output=True, mesh=c.mesh
        )
        torch.manual_seed(1)
        segs = (2 * tp, tp, tp)  # fused QKV-style: each segment split separately
        ref_packed = nn.Linear(5, sum(segs))
        packed = ntp.ColumnParallelLinear.from_linear(ref_packed, segments=segs, mesh=c.mesh)
    gen = _data_gen(2, c.mesh)
    x7, x5 = (
        torch.randn(3, 7, generator=gen),
        torch.randn(B, 3, 5, generator=gen, requires_grad=True),
    )
    skip.to(dev)
    y, b = skip(_dev(x7))
    full_b = ntp.gather_full(b, ntp.get_sharding(skip, "bias"), c.mesh)
    c.add("skip_bias_add out", y, x7 @ ref.weight.T)
    c.add("skip_bias_add bias", full_b, ref.bias)
    y_ref = ref_packed(x5)
    gy = torch.randn(y_ref.shape, generator=gen)
    (y_ref * gy).sum().backward()
    packed.to(dev)
    x = _dev(x5, grad=True)
    local = packed(x)
    want = torch.cat([p.chunk(tp, -1)[r] for p in y_ref.split(segs, -1)], -1)
    local.backward(_dev(torch.cat([p.chunk(tp, -1)[r] for p in gy.split(segs, -1)], -1)))
    c.add("packed out (every segment's chunk)", local, want)
    c.add("packed dX", x.grad, x5.grad)
    _check_params(c, packed, ref_packed, "packed")


def linear_cases(c: Checks) -> None:
    tp = c.mesh.tp_size
    for bias, sp, gather in itertools.product([True, False], repeat=3):
        column_case(c, 7, 3 * tp, bias, sp, gather)  # odd sizes: 7 -> 6 or 12
    for bias, sp, parallel_in in itertools.product([True, False], repeat=3):
        if not (sp and not parallel_in):
            row_case(c, 5 * tp, 7, bias, sp, parallel_in)  # 10 or 20 -> 7
    skip_bias_and_packed_case(c)
    c.flush()


def _shard_edge_ids(tp: int, gen: torch.Generator, n: int) -> torch.Tensor:
    """``n`` ids: the first and last vocab row of every shard (the first ``2 * tp``), then
    random ones (callers overwrite only those)."""
    per = -(-V // tp)
    edges = [i for s in range(tp) for i in (s * per, min((s + 1) * per, V) - 1)]
    return torch.cat([torch.tensor(edges), torch.randint(0, V, (n - len(edges),), generator=gen)])


def embedding_case(c: Checks, sp: bool, padding_idx) -> None:
    tp, r = c.mesh.tp_size, c.mesh.tp_rank
    with serial():
        torch.manual_seed(3)
        ref = nn.Embedding(V, H, padding_idx=padding_idx)
        emb = ntp.VocabParallelEmbedding.from_embedding(ref, sequence_parallel=sp, mesh=c.mesh)
    gen = _data_gen(3, c.mesh)
    ids = _shard_edge_ids(tp, gen, B * S).view(B, S)
    if padding_idx is not None:
        ids[1, -2] = padding_idx
    y_ref = ref(ids)
    gy = torch.randn(y_ref.shape, generator=gen)
    (y_ref * gy).sum().backward()
    emb.to(torch_xla.device())
    y = emb(_dev(ids))
    if sp:
        y_ref, gy = y_ref.chunk(tp, 1)[r], gy.chunk(tp, 1)[r]
    y.backward(_dev(gy))
    what = f"embedding V={V} sp={sp} padding_idx={padding_idx}"
    c.add(f"{what} out", y, y_ref)
    _check_params(c, emb, ref, what)


def cross_entropy_case(c: Checks, smoothing: float, reduction: str, ignore_index: int) -> None:
    tp, r = c.mesh.tp_size, c.mesh.tp_rank
    gen = _data_gen(4, c.mesh)
    logits_full = torch.randn(B, S, V, generator=gen, requires_grad=True)
    labels = _shard_edge_ids(tp, gen, B * S).view(B, S)
    labels[1, -1] = labels[1, -4] = ignore_index
    ref = F.cross_entropy(
        logits_full.flatten(0, 1),
        labels.flatten(),
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=smoothing,
    )
    ref = ref.view(labels.shape) if reduction == "none" else ref
    g = torch.randn(ref.shape, generator=gen)
    (ref * g).sum().backward()
    per = -(-V // tp)
    padded = F.pad(logits_full.detach(), (0, per * tp - V), value=123.0)  # pad must not count
    local = _dev(padded.chunk(tp, -1)[r], grad=True)
    loss = ntp.parallel_cross_entropy(
        local,
        _dev(labels),
        mesh=c.mesh,
        vocab_size=V,
        ignore_index=ignore_index,
        label_smoothing=smoothing,
        reduction=reduction,
    )
    (loss * _dev(g)).sum().backward()
    what = f"cross-entropy smoothing={smoothing} {reduction} ignore_index={ignore_index}"
    c.add(f"{what} loss", loss, ref)
    c.add(
        f"{what} dlogits", local.grad, F.pad(logits_full.grad, (0, per * tp - V)).chunk(tp, -1)[r]
    )


def lm_head_padded_case(c: Checks) -> None:
    """A vocab lm_head tp does not divide: padded shards; gathered output and the loss."""
    with serial():
        torch.manual_seed(5)
        ref = nn.Linear(H, V, bias=False)
        head = ntp.ColumnParallelLinear.from_linear(
            ref, pad_output=True, gather_output=True, mesh=c.mesh
        )
        local_head = ntp.ColumnParallelLinear.from_linear(ref, pad_output=True, mesh=c.mesh)
    gen = _data_gen(5, c.mesh)
    x = torch.randn(B, S, H, generator=gen)
    labels = _shard_edge_ids(c.mesh.tp_size, gen, B * S).view(B, S)
    head.to(torch_xla.device())
    local_head.to(torch_xla.device())
    c.add("padded lm_head gathered", head(_dev(x)), ref(x))
    loss = ntp.parallel_cross_entropy(local_head(_dev(x)), _dev(labels), mesh=c.mesh, vocab_size=V)
    c.add("loss from padded lm_head", loss, F.cross_entropy(ref(x).flatten(0, 1), labels.flatten()))


def vocab_cases(c: Checks) -> None:
    for sp, pad in itertools.product([False, True], [None, 2]):
        embedding_case(c, sp, pad)
    for smoothing, reduction in itertools.product([0.0, 0.1], ["mean", "sum", "none"]):
        cross_entropy_case(c, smoothing, reduction, ignore_index=-100)
    cross_entropy_case(c, 0.1, "mean", ignore_index=4)  # an ignored id inside the vocab
    lm_head_padded_case(c)
    c.flush()


def collective_form(mesh) -> list:
    """Trace and run one all-reduce / all-gather / reduce-scatter on this mesh's tp group;
    returns the collectives of the traced HLO (their form) after checking the values."""
    c = Checks(mesh)
    tp, r = mesh.tp_size, mesh.tp_rank
    base = mesh.dp_rank * tp
    xs = _per_rank(mesh.world_size, (3, 4 * tp), seed=20)[base : base + tp]
    outs = [
        comm.all_reduce(_dev(xs[r]), mesh.tp),
        comm.all_gather(_dev(xs[r]), mesh.tp, 0),
        comm.reduce_scatter(_dev(xs[r]), mesh.tp, 1),
    ]
    hlo = trace_hlo(outs)
    for what, got, want in zip(
        ("all-reduce", "all-gather", "reduce-scatter"),
        outs,
        (sum(xs), torch.cat(xs, 0), sum(xs).chunk(tp, 1)[r]),
    ):
        c.add(what, got, want)
    c.flush()
    return parse_collectives(hlo)


def reduce_dtype_case(mesh) -> None:
    """With ``reduce_dtype=fp32``, sums of bf16 values over the tp group equal the exact sum
    rounded once to bf16 (all-reduce, reduce-scatter: values in [0.5, 2), whose fp32 sum of
    up to 4 is exact in any order), and a bf16 row-parallel layer's output is within half a
    bf16 ulp of the fp32 product (XLA may even skip rounding the partial products, its
    "excess precision"; a bf16 sum over 4 ranks is off by more on some elements)."""
    wide = ntp.Mesh(mesh.world_size, mesh.rank, tp=mesh.tp_size, reduce_dtype=torch.float32)
    tp, r, base = mesh.tp_size, mesh.tp_rank, mesh.dp_rank * mesh.tp_size
    g = torch.Generator().manual_seed(30)
    xs = [(torch.rand(2, 512, generator=g) * 1.5 + 0.5).bfloat16() for _ in range(mesh.world_size)]
    xs = xs[base : base + tp]
    exact = sum(x.float() for x in xs).bfloat16()
    got_ar = comm.all_reduce(_dev(xs[r]), wide.tp)
    got_rs = comm.reduce_scatter(_dev(xs[r]), wide.tp, 1)
    with serial():
        torch.manual_seed(31)
        ref = nn.Linear(256, 128, bias=False).bfloat16()
        layer = ntp.RowParallelLinear.from_linear(ref, mesh=wide, input_is_parallel=False)
    x = xs[0][:, :256]
    got_row = layer.to(torch_xla.device())(_dev(x))
    torch_xla.sync()
    assert got_ar.dtype == torch.bfloat16 and torch.equal(got_ar.cpu(), exact), "all-reduce"
    assert torch.equal(got_rs.cpu(), exact.chunk(tp, 1)[r]), "reduce-scatter"
    want = F.linear(x.float(), ref.weight.float())
    half_ulp = torch.exp2(torch.floor(torch.log2(want.abs())) - 8)
    err = (got_row.cpu().float() - want).abs()
    assert (err <= half_ulp * 1.01).all(), f"row-parallel: {(err > half_ulp).sum()} off > 0.5 ulp"


def job(tps: tuple[int, ...]) -> dict:
    """The whole tier on this device thread, for each tp degree in ``tps``."""
    out = {"checks": 0, "forms": {}}
    for tp in tps:
        mesh = ntp.init_mesh(tp=tp)
        assert ntp.get_mesh() is mesh and dist.get_backend() == "xla"
        out["forms"][tp] = collective_form(mesh)
        if tp >= 3:  # two bf16 values add exactly: only 3+ ranks tell the dtypes apart
            reduce_dtype_case(mesh)
        c = Checks(mesh)
        regions_case(c)
        linear_cases(c)
        vocab_cases(c)
        out["checks"] += c.count
    out["rank"], out["world"] = mesh.rank, mesh.world_size
    return out

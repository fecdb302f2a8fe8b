"""Check 3a: every parallel layer, forward and backward, against the same computation on the
host CPU with plain torch (outputs, input gradients, every gathered weight gradient).

Each rank draws the full weights and inputs from one seeded generator (the same on every
rank), loads its shards (:func:`neuron_tp.parallel.sharding.shard_of`, pure slicing), runs
the layer on the job's device, and compares with ``F.linear`` / ``F.embedding`` /
``F.cross_entropy`` on the host. Sizes are odd where the layer allows it (a vocabulary tp does
not divide). 2D linears run when the world holds a 2 x 2 grid, 3D when it holds a 2 x 2 x 2 cube.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import (
    ColumnParallelLinear,
    Linear2D,
    Linear3D,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_cross_entropy,
)
from ..layers.activation_layout import gather_output, split_input
from ..optim.grads import sync_sequence_parallel_grads
from ..parallel import regions
from ..parallel.mesh import Mesh, get_mesh, init_mesh, set_default_mesh
from ..parallel.sharding import gather_full, get_sharding, shard_of
from .context import Context
from .report import Check

B, S, H = 2, 4, 8  # batch, sequence (a multiple of tp for SP: scaled), hidden per tp rank


def tolerance(ctx: Context) -> float:
    """Relative error allowed: fp32 on the CPU; on Neuron the compiler may run fp32 matmuls
    in bf16 (``--auto-cast``), so bf16's."""
    return 2e-2 if ctx.on_neuron else 1e-4


def load(module: nn.Module, full: dict[str, torch.Tensor], mesh: Mesh) -> None:
    """Copy this rank's shard of each full weight into ``module`` (on the host)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            sharding = get_sharding(module, name)
            p.copy_(full[name] if sharding is None else shard_of(full[name], sharding, mesh))


def draw(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * 0.5


class Compare:
    """Pairs (what, device tensor, host reference) compared after one graph."""

    def __init__(self, ctx: Context, check: Check, name: str):
        self.ctx, self.check, self.name = ctx, check, name
        self.pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = []

    def add(self, what: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
        self.pairs.append((what, got, want))

    def grads(self, module: nn.Module, ref: dict[str, torch.Tensor], mesh: Mesh) -> None:
        for name, p in module.named_parameters():
            got = (
                p.grad if p.grad is None else gather_full(p.grad, get_sharding(module, name), mesh)
            )
            self.add(f"grad {name}", got, ref[name].grad)

    def run(self) -> float:
        """Execute, compare; returns the largest relative error."""
        self.ctx.sync()
        worst, tol = 0.0, tolerance(self.ctx)
        for what, got, want in self.pairs:
            if got is None or want is None:
                self.check.fail(f"rank {self.ctx.rank}: {self.name}: {what} is missing")
                continue
            got = got.detach().float().cpu()
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
            worst = max(worst, err)
            if got.shape != want.shape or err > tol:
                self.check.fail(
                    f"rank {self.ctx.rank}: {self.name}: {what} differs from the host "
                    f"reference (relative error {err:.2e} > {tol:g})"
                )
        return worst


def _leaf(x: torch.Tensor, device) -> torch.Tensor:
    return x.clone().to(device).requires_grad_(True)


def case_column_row(ctx: Context, mesh: Mesh, g: torch.Generator, cmp: Compare, sp: bool):
    """Column -> Row (an MLP), replicated input; ``sp``: sequence-parallel regions instead."""
    tp, dev = mesh.tp, ctx.device
    h, f, s = H * tp.size + 1, 2 * H * tp.size, S * tp.size
    if sp:
        h -= 1  # SP needs a sequence shard and a full hidden
    col = ColumnParallelLinear(h, f, sequence_parallel=sp, mesh=mesh, device="cpu")
    row = RowParallelLinear(f, h, sequence_parallel=sp, mesh=mesh, device="cpu")
    full_c = {"weight": draw(g, f, h), "bias": draw(g, f)}
    full_r = {"weight": draw(g, h, f), "bias": draw(g, h)}
    load(col, full_c, mesh)
    load(row, full_r, mesh)
    x, r = draw(g, B, s, h), draw(g, B, s, h)
    model = nn.Sequential(col, row).to(dev)
    xd = _leaf(x, dev)
    inp = regions.split_fwd_all_gather_bwd(xd, tp, 1) if sp else xd
    y = model[1](F.gelu(model[0](inp)))
    if sp:
        y = regions.all_gather_fwd_split_bwd(y, tp, 1)
    (y * r.to(dev)).sum().backward()
    if sp:
        sync_sequence_parallel_grads(model, mesh)
    ref_c = {k: v.clone().requires_grad_(True) for k, v in full_c.items()}
    ref_r = {k: v.clone().requires_grad_(True) for k, v in full_r.items()}
    xr = x.clone().requires_grad_(True)
    want = F.linear(F.gelu(F.linear(xr, ref_c["weight"], ref_c["bias"])), **ref_r)
    (want * r).sum().backward()
    cmp.add("output", y, want.detach())
    cmp.add("input grad", xd.grad, xr.grad)
    cmp.grads(model[0], ref_c, mesh)
    cmp.grads(model[1], ref_r, mesh)


def case_vocab(ctx: Context, mesh: Mesh, g: torch.Generator, cmp: Compare, _sp: bool):
    """Vocab-parallel embedding -> column-parallel LM head -> parallel cross-entropy, with a
    vocabulary tp does not divide."""
    tp, dev = mesh.tp, ctx.device
    v, h = 8 * tp.size + 3, H * 2
    emb = VocabParallelEmbedding(v, h, mesh=mesh, device="cpu")
    head = ColumnParallelLinear(h, v, bias=False, pad_output=True, mesh=mesh, device="cpu")
    full_e, full_h = {"weight": draw(g, v, h)}, {"weight": draw(g, v, h)}
    load(emb, full_e, mesh)
    load(head, full_h, mesh)
    ids = torch.randint(0, v, (B, S), generator=g)
    labels = torch.randint(0, v, (B, S), generator=g)
    model = nn.ModuleList([emb, head]).to(dev)
    loss = parallel_cross_entropy(
        model[1](model[0](ids.to(dev))), labels.to(dev), mesh=mesh, vocab_size=v
    )
    loss.backward()
    ref_e = {k: t.clone().requires_grad_(True) for k, t in full_e.items()}
    ref_h = {k: t.clone().requires_grad_(True) for k, t in full_h.items()}
    logits = F.linear(F.embedding(ids, ref_e["weight"]), ref_h["weight"])
    want = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1))
    want.backward()
    cmp.add("loss", loss, want.detach())
    cmp.grads(model[0], ref_e, mesh)
    cmp.grads(model[1], ref_h, mesh)


def case_nd(ctx: Context, mesh: Mesh, g: torch.Generator, cmp: Compare, _sp: bool):
    """A 2D linear on a q x q grid, or an up/down pair of 3D linears on a q^3 cube."""
    dev, q = ctx.device, mesh.grid_side
    h, f, b = H * q, 2 * H * q, B * q * q
    layers: list[Linear2D | Linear3D] = (
        [Linear2D(h, f, mesh=mesh, device="cpu")]
        if mesh.tp_mode == "2d"
        else [
            Linear3D(h, f, orientation="ab", mesh=mesh, device="cpu"),
            Linear3D(f, h, orientation="ba", mesh=mesh, device="cpu"),
        ]
    )
    fulls = []
    for layer in layers:
        full = {"weight": draw(g, layer.out_features, layer.in_features)}
        full["bias"] = draw(g, layer.out_features)
        load(layer, full, mesh)
        fulls.append(full)
    x = draw(g, b, S, h)
    r = draw(g, b, S, layers[-1].out_features)
    model = nn.Sequential(*layers).to(dev)
    xd = _leaf(x, dev)
    y = split_input(xd, layers[0].input_layout, mesh)
    for mod in model:
        y = mod(y)
    y = gather_output(y, layers[-1].output_layout, mesh)
    (y * r.to(dev)).sum().backward()
    refs = [{k: t.clone().requires_grad_(True) for k, t in full.items()} for full in fulls]
    xr = x.clone().requires_grad_(True)
    want = xr
    for ref in refs:
        want = F.linear(want, ref["weight"], ref["bias"])
    (want * r).sum().backward()
    cmp.add("output", y, want.detach())
    cmp.add("input grad", xd.grad, xr.grad)
    for mod, ref in zip(model, refs):
        cmp.grads(mod, ref, mesh)


Case = Callable[[Context, Mesh, torch.Generator, Compare, bool], None]


def cases(ctx: Context) -> list[tuple[str, Case, bool, str]]:
    """(name, case, sequence parallel, tp mode) of every layer case the world allows."""
    out: list[tuple[str, Case, bool, str]] = [
        ("column+row", case_column_row, False, "1d"),
        ("column+row SP", case_column_row, True, "1d"),
        ("vocab embedding+CE", case_vocab, False, "1d"),
    ]
    if ctx.world % 4 == 0:
        out.append(("linear 2D", case_nd, False, "2d"))
    if ctx.world % 8 == 0:
        out.append(("linear 3D", case_nd, False, "3d"))
    return out


def check_layers(ctx: Context) -> Check:
    """Every layer case; the largest relative error in the summary."""
    c = Check("layers")
    worst, names = 0.0, []
    before = get_mesh(ctx.mesh)
    try:
        for name, case, sp, mode in cases(ctx):
            tp = {"1d": ctx.mesh.tp_size, "2d": 4, "3d": 8}[mode]
            backend = "gloo" if not ctx.on_xla else None
            mesh = ctx.mesh if mode == "1d" else init_mesh(tp=tp, tp_mode=mode, backend=backend)
            g = torch.Generator().manual_seed(1234)
            cmp = Compare(ctx, c, f"{name} (tp {tp})")
            with ctx.watchdog.doing(f"layer case {name!r} (forward, backward, gathers)"):
                case(ctx, mesh, g, cmp, sp)
                worst = max(worst, cmp.run())
            names.append(name)
    finally:
        set_default_mesh(before)
    c.numbers = {"cases": names, "max_relative_error": worst}
    verb = "match" if c.ok else "do NOT all match"
    c.summary = (
        f"{', '.join(names)}: forward + backward {verb} the host (max rel. error {worst:.1e})"
    )
    if not c.ok:
        c.hint = (
            "a layer disagrees with plain torch while the collectives are exact: a compiler or "
            "numerics issue (try NEURON_CC_FLAGS=--auto-cast=none); report it with --json"
        )
    return c

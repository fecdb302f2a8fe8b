"""Per-rank cost of one transformer block under 1D, 1D+SP, 2D and 3D tensor parallelism.

For each P and each mode that fits (2D: P = q^2, 3D: P = q^3) the block is traced forward +
backward for one rank of a virtual mesh on the XLA CPU device, in a fresh process per case.
Measured, per rank: ring bytes of every collective in the HLO, parameter bytes, the bytes of the
block input (residual stream) and of the tensors autograd saves for backward (parameters
excluded). Theory (elements x 4 bytes; N = batch*seq tokens, h hidden, f ffn, linears
(a -> c) = qkv (h -> 3h), out (h -> h), up (h -> f), down (f -> h)):

* 1D (and 1D+SP): 4 all-reduces (8 all-gathers/reduce-scatters) of N*h: ``8 (P-1)/P N h``
* 2D: ``sum 2 (q-1)/q (N a + a c)/q`` + bias-grad all-reduces ``2 (q-1)/q c/q`` + per LayerNorm
  stats ``2 x 2 (q-1)/q 2N/q`` and affine grads ``2 x 2 (q-1)/q h/q``
* 3D: ``sum 2 (q-1)/q^3 (N a + a c + N c)`` + bias grads ``2 (q^2-1)/q^2 c/q`` + per LayerNorm
  stats ``2 x 2 (q-1)/q 2N/q^2`` and affine grads ``2 x 2 (q^2-1)/q^2 h/q``

    .venv/bin/python benchmarks/tp_scaling.py [--hidden 1024 --seq 512 --batch 16] [--out docs]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from neuron_tp.hlo import parse_collectives  # noqa: E402

CODE = """
import torch, neuron_tp as ntp
from neuron_tp.hlo import trace_hlo
from neuron_tp.blocks_nd import TransformerBlockND
P, mode, sp = {P}, "{mode}", {sp}
b, s, h = {b}, {s}, {h}
dev = ntp.xla_device()
mesh = ntp.Mesh.virtual(world_size=P, rank=P - 1, tp=P, tp_mode="1d" if mode == "1d" else mode)
torch.manual_seed(0)
if mode == "1d":
    block = ntp.blocks.TransformerBlock(h, {heads}, {f}, mesh=mesh, sequence_parallel=sp)
    shape = (b, s // P if sp else s, h)
else:
    block = TransformerBlockND(h, {heads}, {f}, mesh=mesh)
    q = round(P ** (1 / (2 if mode == "2d" else 3)))
    shape = (b // (q if mode == "2d" else q * q), s, h // q)
block = block.to(dev)
params = {{id(p) for p in block.parameters()}}
saved = {{}}
def pack(t):
    if id(t) not in params:
        saved[id(t)] = t
    return t
x = torch.randn(shape, device=dev, requires_grad=True)
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    y = block(x)
y.sum().backward()
print("PARAM_BYTES", sum(p.numel() * 4 for p in block.parameters()))
print("INPUT_BYTES", x.numel() * 4)
print("SAVED_BYTES", sum(t.numel() * t.element_size() for t in saved.values()))
print(trace_hlo([y, x.grad] + [p.grad for p in block.parameters()]))
"""


def trace(P: int, mode: str, sp: bool, b: int, s: int, h: int, f: int, heads: int) -> dict:
    """Run one trace in a fresh process; collectives and byte counts of one rank."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-c", CODE.format(P=P, mode=mode, sp=sp, b=b, s=s, h=h, f=f, heads=heads)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode:
        raise RuntimeError(f"trace P={P} {mode} failed:\n{out.stderr[-3000:]}")
    nums = {k: int(v) for k, v in re.findall(r"^(\w+_BYTES) (\d+)$", out.stdout, re.M)}
    return {"colls": parse_collectives(out.stdout), **nums}


def theory_bytes(mode: str, P: int, N: int, h: int, f: int) -> float:
    """Per-rank ring bytes of one block, fwd + bwd, from the schedules (fp32)."""
    lins = [(h, 3 * h), (h, h), (h, f), (f, h)]
    if mode in ("1d", "1d+sp"):
        return 4 * 8 * (P - 1) / P * N * h
    if mode == "2d":
        q = round(P**0.5)
        k = 2 * (q - 1) / q
        elems = sum(k * (N * a + a * c) / q + k * c / q for a, c in lins)
        elems += 2 * (2 * k * 2 * N / q + 2 * k * h / q)  # two LayerNorms
    else:
        q = round(P ** (1 / 3))
        k, k2 = 2 * (q - 1) / q, 2 * (q * q - 1) / (q * q)
        elems = sum(k / q**2 * (N * a + a * c + N * c) + k2 * c / q for a, c in lins)
        elems += 2 * (2 * k * 2 * N / q**2 + 2 * k2 * h / q)
    return 4 * elems


def colossal_coeff(mode: str, P: int) -> str:
    """The per-GEMM bandwidth coefficient of Colossal-AI's table, and the activation share."""
    if mode in ("1d", "1d+sp"):
        return f"{2 * (P - 1) / P:.3f}", "1" if mode == "1d" else f"1/{P}"
    q = round(P ** (0.5 if mode == "2d" else 1 / 3))
    if mode == "2d":
        return f"{6 * (q - 1) / q:.3f}", f"1/{q * q}"
    return f"{6 * (q - 1) / q**3:.3f}", f"1/{q**3}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--P", type=int, nargs="+", default=[4, 8, 16, 64])
    ap.add_argument("--out", default=None, help="directory for tp_scaling.md and .png")
    args = ap.parse_args()
    h, s, b, heads = args.hidden, args.seq, args.batch, args.heads
    f, N = 4 * h, args.batch * args.seq
    full_act = b * s * h * 4
    rows = []
    head = (
        f"{'P':>3} {'mode':>6} {'collectives (fwd+bwd)':>30} {'comm MiB':>9} "
        f"{'theory':>9} {'ratio':>6} {'colossal':>8} {'param MiB':>9} {'act in':>7} "
        f"{'theory':>7} {'saved MiB':>9}"
    )
    print(
        f"block: hidden={h} ffn={f} heads={heads} batch={b} seq={s} (N={N} tokens) fp32; "
        f"full activation {full_act / 2**20:.0f} MiB"
    )
    print(head)
    for P in args.P:
        modes = ["1d", "1d+sp"]
        if round(P**0.5) ** 2 == P:
            modes.append("2d")
        if round(P ** (1 / 3)) ** 3 == P:
            modes.append("3d")
        for mode in modes:
            r = trace(
                P, "1d" if mode.startswith("1d") else mode, mode == "1d+sp", b, s, h, f, heads
            )
            kinds = Counter(c.kind for c in r["colls"])
            measured = sum(c.ring_bytes for c in r["colls"])
            theory = theory_bytes(mode, P, N, h, f)
            coeff, act_theory = colossal_coeff(mode, P)
            row = dict(
                P=P,
                mode=mode,
                kinds=", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
                comm=measured / 2**20,
                theory=theory / 2**20,
                ratio=measured / theory,
                coeff=coeff,
                param=r["PARAM_BYTES"] / 2**20,
                act=f"1/{full_act / r['INPUT_BYTES']:.0f}" if r["INPUT_BYTES"] != full_act else "1",
                act_theory=act_theory,
                saved=r["SAVED_BYTES"] / 2**20,
            )
            rows.append(row)
            print(
                f"{P:>3} {mode:>6} {row['kinds']:>30} {row['comm']:>9.2f} "
                f"{row['theory']:>9.2f} {row['ratio']:>6.3f} {coeff:>8} {row['param']:>9.2f} "
                f"{row['act']:>7} {act_theory:>7} {row['saved']:>9.1f}",
                flush=True,
            )
    if args.out:
        write_docs(rows, args, N, f)


def write_docs(rows: list[dict], args, N: int, f: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, style in (("1d", "o-"), ("1d+sp", "x--"), ("2d", "s-"), ("3d", "^-")):
        pts = [(r["P"], r["comm"], r["theory"]) for r in rows if r["mode"] == mode]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{mode} measured")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color="gray")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tensor-parallel ranks P")
    ax.set_ylabel("MiB sent per rank per block (fwd+bwd)")
    ax.set_title(f"h={args.hidden}, N={N} tokens, fp32 (dotted: theory)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "tp_scaling.png"), dpi=110)
    lines = [
        "| P | mode | collectives (fwd+bwd) | MiB/rank measured | theory | ratio | "
        "Colossal-AI coeff | param MiB/rank | activation measured | theory | "
        "saved for bwd MiB |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        lines.append(
            f"| {r['P']} | {r['mode']} | {r['kinds']} | {r['comm']:.2f} | "
            f"{r['theory']:.2f} | {r['ratio']:.3f} | {r['coeff']} | {r['param']:.2f} | "
            f"{r['act']} | {r['act_theory']} | {r['saved']:.1f} |"
        )
    table = "\n".join(lines)
    path = os.path.join(args.out, "tp_scaling.md")
    text = open(path).read() if os.path.exists(path) else ""
    start, end = "<!-- table:start -->", "<!-- table:end -->"
    if start in text and end in text:
        text = (
            text[: text.index(start) + len(start)] + "\n" + table + "\n" + text[text.index(end) :]
        )
    else:
        text += f"\n{start}\n{table}\n{end}\n"
    with open(path, "w") as fh:
        fh.write(text)
    print(f"wrote {path} and tp_scaling.png")


if __name__ == "__main__":
    main()

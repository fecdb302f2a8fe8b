"""Per-rank cost of one transformer block under 1D, 1D+SP, 2D and 3D tensor parallelism.

For each P and each mode that fits (2D: P = q^2, 3D: P = q^3) the block is traced forward +
backward for one rank of a virtual mesh on the XLA CPU device, in a fresh process per case.
Measured, per rank: ring bytes of every collective in the HLO, parameter bytes, the bytes of the
block input (residual stream) and of the tensors autograd saves for backward (parameters
excluded). Theory (elements x 4 bytes; N = batch*seq tokens, h hidden, f ffn, linears
(a -> c) = qkv (h -> 3h), out (h -> h), up (h -> f), down (f -> h)):

* 1D: 4 all-reduces of N*h: ``8 (P-1)/P N h``; 1D+SP: 6 all-gathers (2 of them the backward
  re-gathers of the column-parallel inputs) + 4 reduce-scatters: ``10 (P-1)/P N h``
* 2D: ``sum 3 (q-1)/q (N a + a c)/q`` (``2d-keep``, saving the gathered operands: ``2 (q-1)/q``)
  + bias-grad all-reduces ``2 (q-1)/q c/q`` + per LayerNorm stats ``2 x 2 (q-1)/q 2N/q`` and
  affine grads ``2 x 2 (q-1)/q h/q``
* 3D: ``sum (q-1)/q^3 (3 N a + 3 a c + 2 N c)`` (``3d-keep``: ``2 (q-1)/q^3 (N a + a c + N c)``)
  + bias grads ``2 (q^2-1)/q^2 c/q`` + per LayerNorm stats ``2 x 2 (q-1)/q 2N/q^2`` and affine
  grads ``2 x 2 (q^2-1)/q^2 h/q``

2D/3D linears re-gather their input and weight blocks in backward by default (saved activations
1/P); the ``-keep`` rows save the gathered operands instead (``regather=False``).

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

from neuron_tp.backend.hlo import parse_collectives  # noqa: E402

CODE = """
import torch, neuron_tp as ntp
from neuron_tp.backend.hlo import trace_hlo
from neuron_tp.blocks.block_nd import TransformerBlockND
P, mode, sp, regather = {P}, "{mode}", {sp}, {regather}
b, s, h = {b}, {s}, {h}
dev = ntp.xla_device()
mesh = ntp.Mesh.virtual(world_size=P, rank=P - 1, tp=P, tp_mode="1d" if mode == "1d" else mode)
torch.manual_seed(0)
if mode == "1d":
    block = ntp.blocks.TransformerBlock(h, {heads}, {f}, mesh=mesh, sequence_parallel=sp)
    shape = (b, s // P if sp else s, h)
else:
    block = TransformerBlockND(h, {heads}, {f}, mesh=mesh, regather=regather)
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


LLAMA_CODE = """
import torch, transformers as tf, neuron_tp as ntp
from neuron_tp.backend.hlo import trace_hlo
P, mode, sp, regather = {P}, "{mode}", {sp}, {regather}
b, s, h, heads, kv, f = {b}, {s}, {h}, {heads}, {kv}, {f}
cfg = tf.LlamaConfig(vocab_size=64 * 1024, hidden_size=h, intermediate_size=f,
    num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv,
    max_position_embeddings=s, tie_word_embeddings=False)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = tf.AutoModelForCausalLM.from_config(cfg)
mesh = ntp.Mesh.virtual(world_size=P, rank=P - 1, tp=P, tp_mode=mode)
ntp.parallelize(model, mesh, sequence_parallel=sp)
for m in model.modules():  # the 2D/3D linears' schedule (save the blocks or the gathered)
    if hasattr(m, "regather"):
        m.regather = regather
dev = ntp.xla_device()
model.to(dev)
layer = model.model.layers[0]
if mode == "1d":  # under SP the first layer scatters its (full) input itself
    shape = (b, s, h)
else:
    q = round(P ** (1 / (2 if mode == "2d" else 3)))
    shape = (b // (q if mode == "2d" else q * q), s, h // q)
params = {{id(p) for p in layer.parameters()}}
saved = {{}}
def pack(t):
    if id(t) not in params:
        saved[id(t)] = t
    return t
x = torch.randn(shape, device=dev, requires_grad=True)
rope = model.model.rotary_emb(x, torch.arange(s, device=dev).unsqueeze(0))
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    y = layer(x, position_embeddings=rope, attention_mask=None)
    y = y[0] if isinstance(y, tuple) else y
y.sum().backward()
print("PARAM_BYTES", sum(p.numel() * 4 for p in layer.parameters()))
print("INPUT_BYTES", x.numel() * 4)
print("SAVED_BYTES", sum(t.numel() * t.element_size() for t in saved.values()))
print(trace_hlo([y, x.grad] + [p.grad for p in layer.parameters()]))
"""


def trace(
    P: int,
    mode: str,
    sp: bool,
    b: int,
    s: int,
    h: int,
    f: int,
    heads: int,
    regather=True,
    kv: int | None = None,
) -> dict:
    """Run one trace in a fresh process; collectives and byte counts of one rank. With ``kv``
    (key/value heads) one decoder layer of a patched transformers Llama, else the block."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": ROOT}
    fmt = dict(P=P, mode=mode, sp=sp, b=b, s=s, h=h, f=f, heads=heads, regather=regather, kv=kv)
    code = (CODE if kv is None else LLAMA_CODE).format(**fmt)
    out = subprocess.run(
        [sys.executable, "-c", code],
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
    if mode == "1d":
        return 4 * 8 * (P - 1) / P * N * h
    if mode == "1d+sp":  # + the backward re-gathers of the two column-parallel inputs
        return 4 * 10 * (P - 1) / P * N * h
    keep = mode.endswith("-keep")
    if mode.startswith("2d"):
        q = round(P**0.5)
        k = 2 * (q - 1) / q
        lin = k if keep else 1.5 * k  # the re-gather adds one all-gather of X and one of W
        elems = sum(lin * (N * a + a * c) / q + k * c / q for a, c in lins)
        elems += 2 * (2 * k * 2 * N / q + 2 * k * h / q)  # two LayerNorms
    else:
        q = round(P ** (1 / 3))
        k, k2 = 2 * (q - 1) / q, 2 * (q * q - 1) / (q * q)

        def lin(a: int, c: int) -> float:
            if keep:
                return k / q**2 * (N * a + a * c + N * c)
            return (q - 1) / q**3 * (3 * N * a + 3 * a * c + 2 * N * c)

        elems = sum(lin(a, c) + k2 * c / q for a, c in lins)
        elems += 2 * (2 * k * 2 * N / q**2 + 2 * k2 * h / q)
    return 4 * elems


def colossal_coeff(mode: str, P: int) -> str:
    """The per-GEMM bandwidth coefficient of Colossal-AI's table, and the activation share."""
    if mode in ("1d", "1d+sp"):
        return f"{2 * (P - 1) / P:.3f}", "1" if mode == "1d" else f"1/{P}"
    q = round(P ** (0.5 if mode.startswith("2d") else 1 / 3))
    if mode.startswith("2d"):
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
    ap.add_argument(
        "--llama",
        action="store_true",
        help="one decoder layer of a patched transformers Llama (GQA, SwiGLU) instead of the "
        "block: bytes, params and saved activations per rank vs the unsharded layer / P",
    )
    ap.add_argument("--kv-heads", type=int, default=16, help="--llama: key/value heads")
    ap.add_argument("--ffn", type=int, default=2816, help="--llama: intermediate size")
    args = ap.parse_args()
    if args.llama:
        return llama_table(args)
    h, s, b, heads = args.hidden, args.seq, args.batch, args.heads
    f, N = 4 * h, args.batch * args.seq
    full_act = b * s * h * 4
    rows = []
    head = (
        f"{'P':>3} {'mode':>7} {'collectives (fwd+bwd)':>30} {'comm MiB':>9} "
        f"{'theory':>9} {'ratio':>6} {'colossal':>8} {'param MiB':>9} {'act in':>7} "
        f"{'theory':>7} {'saved MiB':>9}"
    )
    print(
        f"block: hidden={h} ffn={f} heads={heads} batch={b} seq={s} (N={N} tokens) fp32; "
        f"full activation {full_act / 2**20:.0f} MiB"
    )
    print(head)
    for P in args.P:
        for mode in _modes(P):
            base = mode.split("-")[0].split("+")[0]
            r = trace(
                P, base, mode == "1d+sp", b, s, h, f, heads, regather=not mode.endswith("-keep")
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
                f"{P:>3} {mode:>7} {row['kinds']:>30} {row['comm']:>9.2f} "
                f"{row['theory']:>9.2f} {row['ratio']:>6.3f} {coeff:>8} {row['param']:>9.2f} "
                f"{row['act']:>7} {act_theory:>7} {row['saved']:>9.1f}",
                flush=True,
            )
    if args.out:
        write_docs(rows, args, N, f)


def _modes(P: int) -> list[str]:
    modes = ["1d", "1d+sp"]
    if round(P**0.5) ** 2 == P:
        modes += ["2d", "2d-keep"]
    if round(P ** (1 / 3)) ** 3 == P:
        modes += ["3d", "3d-keep"]
    return modes


def llama_table(args) -> None:
    """Per-rank cost of one patched Llama decoder layer per mode, against the unsharded one."""
    h, s, b, heads, kv, f = args.hidden, args.seq, args.batch, args.heads, args.kv_heads, args.ffn

    def run(P: int, mode: str) -> dict:
        base = mode.split("-")[0].split("+")[0]
        keep = mode.endswith("-keep")
        return trace(P, base, mode == "1d+sp", b, s, h, f, heads, regather=not keep, kv=kv)

    one = run(1, "1d")
    print(
        f"Llama decoder layer: hidden={h} heads={heads} kv_heads={kv} ffn={f} batch={b} "
        f"seq={s} fp32; unsharded: params {one['PARAM_BYTES'] / 2**20:.1f} MiB, saved "
        f"{one['SAVED_BYTES'] / 2**20:.1f} MiB"
    )
    lines = [
        "| P | mode | collectives (fwd+bwd) | MiB/rank sent | param MiB/rank | "
        "saved MiB/rank | saved / (unsharded/P) |",
        "|" + "---|" * 7,
    ]
    print(lines[0])
    for P in args.P:
        for mode in _modes(P):
            r = run(P, mode)
            kinds = Counter(c.kind for c in r["colls"])
            line = (
                f"| {P} | {mode} | {', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))} | "
                f"{sum(c.ring_bytes for c in r['colls']) / 2**20:.2f} | "
                f"{r['PARAM_BYTES'] / 2**20:.2f} | {r['SAVED_BYTES'] / 2**20:.2f} | "
                f"{r['SAVED_BYTES'] / (one['SAVED_BYTES'] / P):.2f} |"
            )
            lines.append(line)
            print(line, flush=True)
    if args.out:
        _write_table(os.path.join(args.out, "tp_scaling.md"), "llama", "\n".join(lines))


def _write_table(path: str, name: str, table: str) -> None:
    """Replace the ``<!-- name:start -->`` .. ``<!-- name:end -->`` part of ``path``."""
    text = open(path).read() if os.path.exists(path) else ""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start in text and end in text:
        text = (
            text[: text.index(start) + len(start)] + "\n" + table + "\n" + text[text.index(end) :]
        )
    else:
        text += f"\n{start}\n{table}\n{end}\n"
    with open(path, "w") as fh:
        fh.write(text)
    print(f"wrote {path}")


def _plot(rows: list[dict], args, N: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = (("1d", "o-"), ("1d+sp", "x--"), ("2d", "s-"), ("2d-keep", "s--"), ("3d", "^-"))
    for mode, style in (*styles, ("3d-keep", "^--")):
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


def write_docs(rows: list[dict], args, N: int, f: int) -> None:
    try:
        _plot(rows, args, N)
    except ImportError:
        print("matplotlib is not installed: table only, tp_scaling.png not redrawn")
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
    _write_table(os.path.join(args.out, "tp_scaling.md"), "table", "\n".join(lines))


if __name__ == "__main__":
    main()

"""Per-rank communication of one 1D transformer block, forward + backward, read from traced HLO.

For tp in 2..32 the block is traced for one rank of a virtual mesh (world = tp) on the XLA CPU
device, in a fresh process per case; every collective's ring bytes per rank are summed and put
next to the theory:

* plain TP: 4 all-reduces of b*s*h per block (2 forward, 2 backward), ring: 2(p-1)/p each;
* TP + SP keeping the gathered inputs (``sequence_parallel_regather=False``): 4 all-gathers
  + 4 reduce-scatters of b*s*h, ring: (p-1)/p each -> same bytes;
* TP + SP saving only the shard (default): + 2 all-gathers in backward (the qkv and MLP-up
  inputs gathered again for their weight gradients) -> 10 (p-1)/p b*s*h, 1.25x.

    .venv/bin/python benchmarks/comm_volume.py [--hidden 1024 --seq 2048 --batch 1]
"""

from __future__ import annotations

import argparse
from collections import Counter

from neuron_tp.backend.hlo import collectives_in_fresh_process

CODE = """
import torch, neuron_tp as ntp
from neuron_tp.backend.hlo import trace_hlo
mesh = ntp.Mesh.virtual(world_size={tp}, rank=1, tp={tp})
dev = ntp.xla_device()
block = ntp.blocks.TransformerBlock(
    {h}, {heads}, mesh=mesh, sequence_parallel={sp}, sequence_parallel_regather={regather}
).to(dev)
x = torch.randn({b}, {s} // ({tp} if {sp} else 1), {h}, device=dev, requires_grad=True)
y = block(x)
y.sum().backward()
print(trace_hlo([y, x.grad] + [p.grad for p in block.parameters()]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    args = ap.parse_args()
    h, s, b = args.hidden, args.seq, args.batch
    n_bytes = b * s * h * 4  # one fp32 activation [b, s, h]
    print(f"block: hidden={h} seq={s} batch={b} fp32; activation b*s*h = {n_bytes / 2**20:.1f} MiB")
    print(
        f"{'tp':>4} {'mode':>7} {'collectives (fwd+bwd)':>32} {'MiB/rank':>10} "
        f"{'theory':>10} {'ratio':>6}"
    )
    for tp in args.tp:
        # mode: (sp, regather, theory in ring steps of b*s*h): 4 AR of 2 steps each; 4 AG +
        # 4 RS; one more AG per column-parallel input (2) in backward
        modes = {"TP": (False, True, 8), "SP-keep": (True, False, 8), "SP": (True, True, 10)}
        for mode, (sp, regather, steps) in modes.items():
            colls = collectives_in_fresh_process(
                CODE.format(tp=tp, h=h, heads=max(tp, 16), s=s, b=b, sp=sp, regather=regather)
            )
            kinds = Counter(c.kind for c in colls)
            measured = sum(c.ring_bytes for c in colls)
            theory = steps * (tp - 1) / tp * n_bytes
            label = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            print(
                f"{tp:>4} {mode:>7} {label:>32} {measured / 2**20:>10.2f} "
                f"{theory / 2**20:>10.2f} {measured / theory:>6.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

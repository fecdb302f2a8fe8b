"""A small GPT built only from neuron_tp layers, trained for a few steps (the quickstart job).

    torchrun --nproc_per_node=2 scripts/demo_tiny_gpt.py --tp 2

Vocab-parallel embedding -> N transformer blocks (column/row-parallel attention and MLP,
optionally sequence-parallel) -> vocab-parallel lm_head -> parallel cross-entropy, on the
bytes of this repository's README. Works on gloo CPU ranks and on XLA devices (--device xla).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn

import neuron_tp as ntp
from neuron_tp.parallel import regions


class TinyGPT(nn.Module):
    def __init__(
        self,
        vocab: int,
        hidden: int,
        heads: int,
        layers: int,
        *,
        seq: int,
        sp: bool,
        mesh: ntp.Mesh,
    ):
        super().__init__()
        self.mesh, self.sp = mesh, sp
        self.embed = ntp.VocabParallelEmbedding(vocab, hidden, mesh=mesh)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = nn.ModuleList(
            ntp.blocks.TransformerBlock(hidden, heads, mesh=mesh, sequence_parallel=sp)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(hidden)
        if sp:
            ntp.mark_sequence_parallel(self.norm)
        self.head = ntp.ColumnParallelLinear(
            hidden, vocab, bias=False, pad_output=True, sequence_parallel=sp, mesh=mesh
        )
        self.vocab = vocab

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        if self.sp:  # the residual stream lives on sequence shards between the linears
            x = regions.split_fwd_all_gather_bwd(x, self.mesh.tp, 1)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))  # [b, s, vocab/tp]
        return ntp.parallel_cross_entropy(logits, labels, vocab_size=self.vocab)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", choices=["cpu", "xla"], default="cpu")
    args = ap.parse_args()

    device = ntp.xla_device() if args.device == "xla" else torch.device("cpu")
    mesh = ntp.init_mesh(tp=args.tp)
    torch.manual_seed(0)  # same seed on every rank: TP-invariant initialisation
    model = TinyGPT(
        256, args.hidden, 4, args.layers, seq=args.seq_len, sp=args.sequence_parallel, mesh=mesh
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.tensor(
        list(Path(__file__).resolve().parents[1].joinpath("README.md").read_bytes()),
        dtype=torch.long,
    )
    g = torch.Generator().manual_seed(1000 + mesh.dp_rank)  # each dp replica its own batches
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        print(f"{mesh}, {sum(p.numel() for p in model.parameters())} parameters per rank")
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,), generator=g)
        chunk = torch.stack([data[s : s + args.seq_len + 1] for s in starts]).to(device)
        loss = model(chunk[:, :-1], chunk[:, 1:])
        loss.backward()
        ntp.sync_sequence_parallel_grads(model, mesh)
        ntp.allreduce_data_parallel_grads(model, mesh)
        ntp.clip_grad_norm_(model, 1.0, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.device == "xla":
            import torch_xla

            torch_xla.sync()
        if rank0 and (step % 5 == 0 or step == 1):
            tokens = step * args.batch * args.seq_len * mesh.dp_size
            print(
                f"step {step:4d}  loss {loss.item():.4f}  "
                f"{tokens / (time.perf_counter() - t0):.0f} tok/s",
                flush=True,
            )


if __name__ == "__main__":
    main()

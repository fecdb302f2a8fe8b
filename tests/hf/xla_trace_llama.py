"""Run in a fresh process (PJRT_DEVICE=CPU): trace a patched tiny Llama for rank 3 of a
virtual 32-rank job with tp=8 (or ``--rank N``) and print its collectives as JSON; with
``--tp1`` first run the tp=1 patched model on the real XLA CPU device and compare with the CPU
model."""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import transformers as tf

import neuron_tp as ntp
from neuron_tp.backend.hlo import parse_collectives, trace_hlo
from neuron_tp.hf import parallelize

B, S, H, V, LAYERS = 2, 16, 64, 100, 2


def _model():
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "sdpa"
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


def main() -> None:
    sp, backward, tp1 = "--sp" in sys.argv, "--backward" in sys.argv, "--tp1" in sys.argv
    dev = ntp.xla_device()
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    report = {}
    if tp1:
        import torch_xla

        ref = _model()
        want = ref(ids).logits
        m = parallelize(_model(), mesh=ntp.Mesh(1, 0, tp=1)).to(dev)
        got = m(ids.to(dev)).logits
        torch_xla.sync()
        report["tp1_max_diff"] = (got.cpu() - want).abs().max().item()
    rank = int(sys.argv[sys.argv.index("--rank") + 1]) if "--rank" in sys.argv else 3
    mesh = ntp.Mesh.virtual(world_size=32, rank=rank, tp=8)
    m = parallelize(_model(), mesh=mesh, sequence_parallel=sp, parallel_loss=backward).to(dev)
    x = ids.to(dev)
    if backward:
        out = m(x, labels=x)
        out.loss.backward()
        tensors = [out.loss] + [p.grad for p in m.parameters() if p.grad is not None]
    else:
        tensors = [m(x).logits]
    hlo = trace_hlo(tensors)
    report["hlo_sha"] = hashlib.sha256(hlo.encode()).hexdigest()
    report["collectives"] = [
        [c.kind, list(c.shape), [list(g) for g in c.replica_groups]] for c in parse_collectives(hlo)
    ]
    print("JSON" + json.dumps(report))


if __name__ == "__main__":
    main()

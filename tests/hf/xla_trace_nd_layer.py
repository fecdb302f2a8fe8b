"""Run in a fresh process (PJRT_DEVICE=CPU): trace forward + backward of decoder layer 0 of a
tiny transformers Llama patched by ``ntp.parallelize`` for the last rank of a virtual
``--tp P --mode 2d|3d`` mesh (nothing executes) and print its collectives as JSON."""

from __future__ import annotations

import json
import sys

import torch
import transformers as tf

import neuron_tp as ntp
from neuron_tp.backend.hlo import parse_collectives, trace_hlo

B, S, H, HEADS, KV, FFN = 16, 8, 64, 8, 4, 96


def main() -> None:
    P, mode = int(sys.argv[sys.argv.index("--tp") + 1]), sys.argv[sys.argv.index("--mode") + 1]
    cfg = tf.LlamaConfig(
        vocab_size=101,
        hidden_size=H,
        intermediate_size=FFN,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        max_position_embeddings=S,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    mesh = ntp.Mesh.virtual(world_size=P, rank=P - 1, tp=P, tp_mode=mode)
    ntp.parallelize(model, mesh)
    dev = ntp.xla_device()
    model.to(dev)
    q = round(P ** (1 / (2 if mode == "2d" else 3)))
    x = torch.randn(B // (q if mode == "2d" else q * q), S, H // q, device=dev, requires_grad=True)
    layer = model.model.layers[0]
    rope = model.model.rotary_emb(x, torch.arange(S, device=dev).unsqueeze(0))
    y = layer(x, position_embeddings=rope, attention_mask=None)
    y = y[0] if isinstance(y, tuple) else y
    y.sum().backward()
    hlo = trace_hlo([y, x.grad] + [p.grad for p in layer.parameters()])
    colls = [
        [c.kind, list(c.shape), [list(g) for g in c.replica_groups]] for c in parse_collectives(hlo)
    ]
    print("JSON" + json.dumps({"collectives": colls}))


if __name__ == "__main__":
    main()

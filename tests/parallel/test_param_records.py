"""Parameter records (sharding, sequence-parallel mark, HF layout) survive what makes new
Parameter objects: ``module.to(xla_device)`` (every layer type, a patched HF model), and the
records a checkpoint stores are the same before and after the move. The move runs on a virtual
tp=2 / tp=4 / 2D / 3D mesh on the real XLA CPU device, in a fresh process."""

from __future__ import annotations

import json
import os

import xla_zygote

HERE = os.path.dirname(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))

SCRIPT = r"""
import json, math, torch, neuron_tp as ntp
from torch import nn
from neuron_tp import layers as L
from neuron_tp.blocks import TransformerBlock
from neuron_tp.blocks.block_nd import TransformerBlockND
from neuron_tp.checkpoint.writer import _metadata
from neuron_tp.backend.hlo import trace_hlo, parse_collectives
from neuron_tp.parallel.sharding import named_parameter_meta

dev = ntp.xla_device()

def records(model):
    return [(n, repr(m)) for n, _, m in named_parameter_meta(model)]

def build_1d(mesh):
    return nn.ModuleDict({
        "col": L.ColumnParallelLinear(8, 8, mesh=mesh),
        "packed": L.ColumnParallelLinear(8, 12, segments=(4, 4, 4), mesh=mesh),
        "row": L.RowParallelLinear(8, 8, sequence_parallel=True, mesh=mesh),
        "emb": L.VocabParallelEmbedding(11, 8, mesh=mesh),
        "block": TransformerBlock(8, 2, 12, mesh=mesh, sequence_parallel=True)})

def build_hf(mesh):
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=51, hidden_size=32, intermediate_size=40,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    return ntp.parallelize(model, mesh, sequence_parallel=True, parallel_loss=True)

out = {}
cases = [("1d", ntp.Mesh.virtual(4, 1, tp=2), build_1d),
         ("2d", ntp.Mesh.virtual(4, 3, tp=4, tp_mode="2d"),
          lambda m: TransformerBlockND(8, 2, 12, mesh=m)),
         ("3d", ntp.Mesh.virtual(8, 5, tp=8, tp_mode="3d"),
          lambda m: TransformerBlockND(8, 2, 16, mesh=m)),
         ("hf", ntp.Mesh.virtual(4, 2, tp=4), build_hf)]
def meta(model, mesh):
    return _metadata(model, None, None, 0, mesh=mesh, data_state=None, extra=None)


for name, mesh, build in cases:
    model = build(mesh)
    before, meta_before = records(model), meta(model, mesh)
    model.to(dev)
    after, meta_after = records(model), meta(model, mesh)
    sp = [n for n, _, m in named_parameter_meta(model) if m.sum_grad_over_tp]
    out[name] = {"same": before == after, "n": len(after),
                 "sharded": sum("splits=" in r for _, r in after), "sp": sp,
                 "meta_same": meta_before["params"] == meta_after["params"]}
    if name == "1d":
        # the loop's sharding-dependent steps see the records on the moved model:
        # sync_sequence_parallel_grads all-reduces exactly the SP-marked gradients over tp
        for _, p, _ in named_parameter_meta(model):
            p.grad = torch.ones_like(p)
        ntp.sync_sequence_parallel_grads(model, mesh)
        grads = [p.grad for n, p, _ in named_parameter_meta(model) if n in sp]
        colls = parse_collectives(trace_hlo(grads))
        out[name]["sp_sync_elems"] = sum(math.prod(c.shape) for c in colls
                                         if c.kind == "all-reduce")
        out[name]["sp_elems"] = sum(g.numel() for g in grads)
print("JSON" + json.dumps(out))
"""


def _run_fresh(code: str) -> dict:
    """Run ``code`` on the XLA CPU device in a fresh process; its ``JSON...`` line, parsed."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
    proc = xla_zygote.python(["-c", code], env, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))[4:])


def test_records_survive_move_to_xla_device():
    res = _run_fresh(SCRIPT)
    for name, r in res.items():
        assert r["same"] and r["meta_same"], f"{name}: records changed by .to(xla): {r}"
        assert r["sharded"] > 0, f"{name}: no sharded parameter recorded at all: {r}"
    # 1D: the SP row bias, the block's norms and row-parallel biases; HF: every norm under SP
    assert sorted(res["1d"]["sp"]) == sorted(
        [
            "row.bias",
            "block.ln1.weight",
            "block.ln1.bias",
            "block.ln2.weight",
            "block.ln2.bias",
            "block.attn.out.bias",
            "block.mlp.down.bias",
        ]
    )
    assert res["1d"]["sp_sync_elems"] == res["1d"]["sp_elems"] > 0
    assert any(n.endswith("norm.weight") for n in res["hf"]["sp"])


TIED = r"""
import json, torch, neuron_tp as ntp, transformers as tf
cfg = tf.GPT2Config(vocab_size=51, n_embd=16, n_layer=1, n_head=2, n_positions=32)
torch.manual_seed(0)
mesh = ntp.Mesh.virtual(2, 1, tp=2)
model = ntp.parallelize(tf.AutoModelForCausalLM.from_config(cfg), mesh, parallel_loss=True)
tied_before = model.lm_head.weight is model.transformer.wte.weight
plain = ntp.parallelize(tf.AutoModelForCausalLM.from_config(cfg), mesh, parallel_loss=True)
plain.to(ntp.xla_device())                     # what torch does: ties come apart
ntp.move_to(model, ntp.xla_device())
print("JSON" + json.dumps({
    "before": tied_before, "plain_to": plain.lm_head.weight is plain.transformer.wte.weight,
    "move_to": model.lm_head.weight is model.transformer.wte.weight,
    "device": str(model.lm_head.weight.device),
    "records": repr(ntp.get_sharding(model, "lm_head.weight"))}))
"""


def test_move_to_keeps_tied_embeddings_tied():
    res = _run_fresh(TIED)
    assert res["before"] and res["move_to"] and res["device"].startswith("xla")
    assert not res["plain_to"]  # the hazard move_to exists for (if torch changes, drop it)
    assert "splits=(('tp', 0),)" in res["records"]


def test_cpu_shards_do_not_keep_the_full_weight_alive():
    """A rank's shard owns its storage: a view of the full initial weight would keep all t
    shards' memory alive on every CPU rank."""
    import neuron_tp as ntp
    from neuron_tp.layers import ColumnParallelLinear, RowParallelLinear

    mesh = ntp.Mesh.virtual(world_size=4, rank=1, tp=4)
    for layer in (ColumnParallelLinear(16, 32, mesh=mesh), RowParallelLinear(32, 16, mesh=mesh)):
        for name, p in layer.named_parameters():
            own = p.numel() * p.element_size()
            assert p.untyped_storage().nbytes() == own, (type(layer).__name__, name)

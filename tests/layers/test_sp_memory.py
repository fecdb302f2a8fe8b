"""Sequence parallelism divides every saved activation by tp: the column-parallel linears save
their sequence shard and all-gather it again in backward (``sequence_parallel_regather``,
the default), against the unsharded computation; the saved-for-backward bytes per rank
(storage-deduplicated) of a TransformerBlock and of a patched Llama, with and without it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from block_reference import FFN, HEADS, HID, ref_block  # noqa: E402
from neuron_tp.parallel import regions  # noqa: E402
from reference import assert_close, full_param_and_grad  # noqa: E402
from saved_bytes import SavedBytes  # noqa: E402

B, S = 2, 8


def _linear_pair(mesh, regather: bool, dim: int) -> None:
    """Column(SP) -> gelu -> Row(SP) against two nn.Linear; ``dim``: the sequence dim."""
    torch.manual_seed(3)
    ref_up, ref_down = nn.Linear(HID, FFN), nn.Linear(FFN, HID)
    kw = {"sequence_parallel": True, "sequence_dim": dim}
    up = ntp.ColumnParallelLinear.from_linear(
        ref_up, mesh=mesh, sequence_parallel_regather=regather, **kw
    )
    down = ntp.RowParallelLinear.from_linear(ref_down, mesh=mesh, **kw)
    shape = (B, S, HID) if dim == 1 else (S, B, HID)
    x_full = torch.randn(shape, requires_grad=True)
    y_ref = ref_down(F.gelu(ref_up(x_full)))
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().backward()
    tp = mesh.tp
    x = regions.split_fwd_all_gather_bwd(x_full.detach(), tp, dim).clone().requires_grad_()
    y = down(F.gelu(up(x)))
    tag = f"pair tp={tp.size} regather={regather} dim={dim}"
    assert_close(y, y_ref.chunk(tp.size, dim)[tp.rank].detach(), f"{tag} out")
    y.backward(g.chunk(tp.size, dim)[tp.rank])
    assert_close(x.grad, x_full.grad.chunk(tp.size, dim)[tp.rank], f"{tag} dX")
    ntp.sync_sequence_parallel_grads(down, mesh)
    for layer, ref in ((up, ref_up), (down, ref_down)):
        for name, _ in layer.named_parameters():
            _, got = full_param_and_grad(layer, name, mesh)
            assert_close(got, getattr(ref, name).grad, f"{tag} d{name}")


def _block(mesh, regather: bool) -> None:
    """TransformerBlock with SP against the plain-torch block of block_reference."""
    torch.manual_seed(0)
    block = ntp.blocks.TransformerBlock(
        HID, HEADS, FFN, mesh=mesh, sequence_parallel=True, sequence_parallel_regather=regather
    )
    with torch.no_grad():
        for ln in (block.ln1, block.ln2):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.5, 0.5)
    full = {n: t.clone().requires_grad_(True) for n, t in ntp.gather_params(block, mesh).items()}
    torch.manual_seed(1)
    x_full = torch.randn(B, S, HID, requires_grad=True)
    y_ref = ref_block(full, x_full)
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().backward()
    tp = mesh.tp
    x = regions.split_fwd_all_gather_bwd(x_full.detach(), tp, 1).clone().requires_grad_()
    y = block(x)
    tag = f"block tp={tp.size} regather={regather}"
    assert_close(y, y_ref.chunk(tp.size, 1)[tp.rank].detach(), f"{tag} out", atol=2e-5)
    y.backward(g.chunk(tp.size, 1)[tp.rank])
    assert_close(x.grad, x_full.grad.chunk(tp.size, 1)[tp.rank], f"{tag} dX", atol=2e-5)
    ntp.sync_sequence_parallel_grads(block, mesh)
    for n, got in ntp.gather_params(block, mesh, grads=True).items():
        assert_close(got, full[n].grad, f"{tag} d{n}", atol=2e-5)


def _llama(mesh, regather: bool) -> None:
    """Patched HF Llama (GQA) with SP: logits, loss and every gradient."""
    from hf_archs import V, build
    from neuron_tp.hf import gather_hf_state_dict, parallelize

    torch.manual_seed(0)
    ref = build("llama").eval()
    ids = torch.randint(0, V, (B, S))
    m = parallelize(
        copy.deepcopy(ref),
        mesh,
        sequence_parallel=True,
        parallel_loss=True,
        sequence_parallel_regather=regather,
    )
    tag = f"llama tp={mesh.tp_size} regather={regather}"
    ref_loss, loss = ref(ids, labels=ids).loss, m(ids, labels=ids).loss
    assert_close(loss, ref_loss, f"{tag} loss")
    ref_loss.backward()
    loss.backward()
    ntp.sync_sequence_parallel_grads(m, mesh)
    grads = gather_hf_state_dict(m, grads=True)
    expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(grads) == set(expected), f"{tag}: {set(grads) ^ set(expected)}"
    for n, want in expected.items():
        assert_close(grads[n], want, f"{tag} grad {n}")


MEM_HID, MEM_HEADS, MEM_S, MEM_B = 512, 8, 256, 2
LIMIT = 1.1  # x (unsharded bytes / tp); keeping the gathered inputs saves > 1.1x the re-gather


def _block_saved(mesh, sp: bool, regather: bool = True) -> int:
    torch.manual_seed(0)
    block = ntp.blocks.TransformerBlock(
        MEM_HID, MEM_HEADS, mesh=mesh, sequence_parallel=sp, sequence_parallel_regather=regather
    )
    s = MEM_S // mesh.tp_size if sp else MEM_S
    x = torch.randn(MEM_B, s, MEM_HID, requires_grad=True)
    count = SavedBytes(block)
    with count.hooks:
        y = block(x)
    y.sum().backward()
    return count.total


def _block_memory(_mesh) -> None:
    """Saved bytes per rank of one block: <= LIMIT x unsharded/tp with the re-gather, more
    than 1.1x that keeping the gathered inputs."""
    tp = _mesh.tp_size
    unsharded = _block_saved(ntp.init_mesh(tp=1), sp=False)
    mesh = ntp.init_mesh(tp=tp)
    ratio = {r: _block_saved(mesh, True, r) / (unsharded / tp) for r in (True, False)}
    print(f"block saved bytes / (unsharded/tp) at tp={tp}: {ratio}", flush=True)
    assert ratio[True] <= LIMIT, ratio
    assert ratio[False] > 1.1 * ratio[True], ratio


def _llama_saved(mesh, sp: bool, regather: bool = True) -> int:
    """Saved bytes of the decoder layers of a patched Llama (hidden 256, 2 layers)."""
    import transformers as tf

    from neuron_tp.hf import parallelize

    cfg = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=MEM_S,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_config(cfg)
    m = parallelize(m, mesh, sequence_parallel=sp, sequence_parallel_regather=regather)
    count = SavedBytes(m)
    layers = m.model.layers
    layers[0].register_forward_pre_hook(lambda *_: count.hooks.__enter__())
    layers[-1].register_forward_hook(lambda *_: count.hooks.__exit__(None, None, None))
    ids = torch.randint(0, 64, (MEM_B, MEM_S))
    m(ids).logits.float().sum().backward()
    return count.total


def _llama_memory(_mesh) -> None:
    tp = _mesh.tp_size
    unsharded = _llama_saved(ntp.init_mesh(tp=1), sp=False)
    mesh = ntp.init_mesh(tp=tp)
    ratio = {r: _llama_saved(mesh, True, r) / (unsharded / tp) for r in (True, False)}
    print(f"llama layers saved bytes / (unsharded/tp) at tp={tp}: {ratio}", flush=True)
    assert ratio[True] <= LIMIT, ratio
    assert ratio[False] > 1.1 * ratio[True], ratio


CASES = {
    "pair-regather": lambda mesh: _linear_pair(mesh, True, 1),
    "pair-regather-seqdim0": lambda mesh: _linear_pair(mesh, True, 0),
    "pair-keep": lambda mesh: _linear_pair(mesh, False, 1),
    "block-regather": lambda mesh: _block(mesh, True),
    "block-keep": lambda mesh: _block(mesh, False),
    "llama-regather": lambda mesh: _llama(mesh, True),
    "llama-keep": lambda mesh: _llama(mesh, False),
    "memory-block": _block_memory,
    "memory-llama": _llama_memory,
}


def _case(case: str, tp: int) -> None:
    CASES[case](gloo_dist.shared_mesh(tp))


@pytest.mark.parametrize(
    "tp, case",
    [(tp, c) for tp in (2, 4) for c in CASES],
    ids=[f"tp{t}-{c}" for t in (2, 4) for c in CASES],
)
def test_sp_regather(tp, case):
    gloo_dist.run_case(_case, case, tp, cases=list(CASES), world_size=tp)

"""HF patcher vs the unsharded transformers model: logits, loss, every parameter gradient,
greedy generation and checkpoints, on gloo ranks (tp 2 and 4), tiny random configs."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from hf_archs import ARCHS, V, build  # noqa: E402
from neuron_tp.hf import (  # noqa: E402
    from_pretrained,
    full_logits,
    gather_hf_state_dict,
    parallelize,
    save_pretrained,
)

ATOL = 1e-5


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")


def _check_arch(name: str, sp: bool, ids: torch.Tensor) -> None:
    torch.manual_seed(0)
    ref = (KV2[name]() if name in KV2 else build(name)).eval()
    tag = f"{name} tp={ntp.get_mesh().tp_size} sp={sp}"
    m = parallelize(copy.deepcopy(ref), sequence_parallel=sp)
    _close(m(ids).logits, ref(ids).logits, f"{tag} logits")
    # Training mode: vocab-sharded head, parallel cross-entropy, then every gradient.
    m = parallelize(copy.deepcopy(ref), sequence_parallel=sp, parallel_loss=True)
    ref_loss, loss = ref(ids, labels=ids).loss, m(ids, labels=ids).loss
    _close(loss, ref_loss, f"{tag} loss")
    n = torch.tensor(5)  # HF gradient-accumulation normalisation: sum / num_items_in_batch
    _close(
        m(ids, labels=ids, num_items_in_batch=n).loss,
        ref(ids, labels=ids, num_items_in_batch=n).loss,
        f"{tag} loss / num_items",
    )
    ref_loss.backward()
    loss.backward()
    ntp.sync_sequence_parallel_grads(m)
    grads = gather_hf_state_dict(m, grads=True)
    expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(grads) == set(expected), f"{tag}: gradient names differ {set(grads) ^ set(expected)}"
    for n, g in expected.items():
        _close(grads[n], g, f"{tag} grad {n}")


def _gqa_uneven(tp: int) -> None:
    """12 query heads over 3 kv heads: tp=2 and tp=4 both need replicated, uneven kv slots."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=V,
        hidden_size=36,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=12,
        num_key_value_heads=3,
        head_dim=4,
    )
    torch.manual_seed(1)
    ref = tf.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, V, (2, 8))
    m = parallelize(copy.deepcopy(ref), parallel_loss=True)
    ref_loss, loss = ref(ids, labels=ids).loss, m(ids, labels=ids).loss
    _close(loss, ref_loss, f"gqa 12/3 tp={tp} loss")
    ref_loss.backward()
    loss.backward()
    grads = gather_hf_state_dict(m, grads=True)
    for n, p in ref.named_parameters():
        _close(grads[n], p.grad, f"gqa 12/3 tp={tp} grad {n}")
    _close(parallelize(copy.deepcopy(ref))(ids).logits, ref(ids).logits, "gqa 12/3 logits")


def _olmo2_kv2():
    import transformers as tf

    cfg = tf.Olmo2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return tf.AutoModelForCausalLM.from_config(cfg)


def _olmoe_kv2():
    from moe_archs import build_moe

    return build_moe("olmoe", num_key_value_heads=2)


# Full-width k norms (over all kv heads) with 2 kv heads: at tp 4 each kv head is copied on 2
# ranks and the norm's statistics span the ranks (tp 2: the plain split).
KV2 = {"olmo2_kv2": _olmo2_kv2, "olmoe_kv2": _olmoe_kv2}

# Every architecture without and (where supported) with sequence parallelism, then uneven GQA.
ARCH_CASES = [
    name + sp for name, (_, _, sp_ok) in ARCHS.items() for sp in (("", "-sp") if sp_ok else ("",))
] + ["gqa_12_3_uneven", "olmo2_kv2", "olmo2_kv2-sp", "olmoe_kv2"]
# tp 4 (kv heads replicated for most configs): every architecture without SP, and SP once; SP
# is proven per architecture at tp 2 (it gathers the sequence before the attention projections,
# whatever the kv layout).
ARCH_CASES_TP4 = [c for c in ARCH_CASES if not c.endswith("-sp")] + ["llama-sp", "olmo2_kv2-sp"]


def _arch_case(case: str, tp: int) -> None:
    """One of ``ARCH_CASES`` on this rank (all of them run in one launch per tp)."""
    gloo_dist.shared_mesh(tp)
    if case == "gqa_12_3_uneven":
        _gqa_uneven(tp)
        return
    ids = torch.randint(2, V, (2, 8), generator=torch.Generator().manual_seed(123))
    _check_arch(case.removesuffix("-sp"), case.endswith("-sp"), ids)


def _generate_and_checkpoints(tmp: str) -> None:
    mesh = ntp.init_mesh(tp=2)
    ids = torch.randint(2, V, (1, 5), generator=torch.Generator().manual_seed(7))
    for name in ("llama", "gpt2"):
        torch.manual_seed(0)
        ref = build(name).eval()
        m = parallelize(copy.deepcopy(ref))
        want = ref.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        got = m.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        assert got.shape[1] == ids.shape[1] + 16 and torch.equal(got, want), (name, got, want)
        train = parallelize(copy.deepcopy(ref), parallel_loss=True)
        assert train(ids).logits.shape[-1] == -(-V // 2)  # vocab-sharded (padded) head output
        with full_logits(train):
            got = train.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        assert torch.equal(got, want), (name, "parallel_loss model under full_logits")

    # Checkpoints written by plain transformers: one file, and a sharded index; GPT-2 (Conv1D,
    # fused c_attn, tied head) and a GQA model whose kv heads are replicated at tp=2.
    for name in ("llama", "gpt2", "gqa_12_3"):
        ref = _gqa_model() if name == "gqa_12_3" else build(name).eval()
        _checkpoints(ref, os.path.join(tmp, name), mesh.rank)


def _gqa_model():
    import transformers as tf

    torch.manual_seed(1)
    cfg = tf.LlamaConfig(
        vocab_size=V,
        hidden_size=36,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=12,
        num_key_value_heads=3,
        head_dim=4,
    )
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


def _checkpoints(ref, tmp: str, rank: int) -> None:
    import transformers as tf

    single, sharded, out = (os.path.join(tmp, d) for d in ("single", "sharded", "out"))
    if rank == 0:
        ref.save_pretrained(single)
        ref.save_pretrained(sharded, max_shard_size="20KB")
    torch.distributed.barrier()
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    x = torch.randint(0, V, (2, 8))
    for path in (single, sharded):
        loaded = from_pretrained(path)
        expected = parallelize(tf.AutoModelForCausalLM.from_pretrained(path).eval())
        for (n, p), (n2, q) in zip(loaded.named_parameters(), expected.named_parameters()):
            assert n == n2 and torch.equal(p, q), n
        _close(loaded(x).logits, ref(x).logits, f"from_pretrained {path}")
    half = from_pretrained(sharded, torch_dtype=torch.bfloat16)
    full = gather_hf_state_dict(half)
    for n, p in ref.named_parameters():
        assert full[n].dtype == torch.bfloat16 and torch.equal(full[n], p.to(torch.bfloat16)), n
    save_pretrained(loaded, out)  # returns once written: every rank reads it at once
    back = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    _close(back(x).logits, ref(x).logits, f"save_pretrained reload {tmp}")
    for n, p in ref.state_dict().items():
        assert torch.equal(back.state_dict()[n], p), n


@pytest.mark.parametrize(
    "tp, case",
    [(2, case) for case in ARCH_CASES] + [(4, case) for case in ARCH_CASES_TP4],
    ids=lambda v: f"tp{v}" if isinstance(v, int) else v,
)
def test_architecture(tp, case):
    cases = ARCH_CASES if tp == 2 else ARCH_CASES_TP4
    gloo_dist.run_case(_arch_case, case, tp, cases=cases, world_size=tp)


def test_generate_and_checkpoints(tmp_path):
    gloo_dist.run(_generate_and_checkpoints, str(tmp_path), world_size=2)

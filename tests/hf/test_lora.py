"""LoRA (peft) on tensor-parallel models vs the unsharded peft model: logits, loss, every
adapter gradient, the global grad norm, adapter save / load and merge, refusals; gloo ranks
(tp 2, 4 and 3), and one executed XLA case (2 CPU devices)."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

pytest.importorskip("peft")

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from lora_models import base_model, lora_config, peft_model, sample_ids  # noqa: E402
from neuron_tp.errors import UserError  # noqa: E402
from neuron_tp.hf import gather_hf_state_dict, parallelize  # noqa: E402
from neuron_tp.hf.lora import load_adapter, merge_adapters, save_adapter  # noqa: E402
from neuron_tp.parallel.state import is_parallel  # noqa: E402

ATOL = 2e-5


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def _check_training(name: str, sp: bool, parallel_loss: bool) -> None:
    ref = peft_model(name)
    tag = f"{name} tp={ntp.get_mesh().tp_size} sp={sp}"
    m = parallelize(copy.deepcopy(ref), sequence_parallel=sp, parallel_loss=parallel_loss)
    assert all(not p.requires_grad for n, p in m.named_parameters() if "lora_" not in n)
    ids = sample_ids()
    out, want = m(ids, labels=ids), ref(ids, labels=ids)
    if not parallel_loss:
        _close(out.logits, want.logits, f"{tag} logits")
    _close(out.loss, want.loss, f"{tag} loss")
    want.loss.backward()
    out.loss.backward()
    ntp.sync_sequence_parallel_grads(m)
    grads = gather_hf_state_dict(m, grads=True)
    expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert expected and set(grads) == set(expected), set(grads) ^ set(expected)
    for n, g in expected.items():
        _close(grads[n], g, f"{tag} grad {n}")
    norm = torch.sqrt(sum(g.pow(2).sum() for g in expected.values()))
    _close(ntp.global_grad_norm(m), norm, f"{tag} global_grad_norm")


def _check_adapter_io(name: str, tmp: str) -> None:
    from peft import PeftModel

    rank, tp = ntp.get_mesh().rank, ntp.get_mesh().tp_size
    tmp = os.path.join(tmp, f"{name}-tp{tp}")
    ids = sample_ids()
    ref = peft_model(name)
    m = parallelize(copy.deepcopy(ref))
    # save_adapter -> plain peft loads it on the unsharded base
    save_adapter(m, os.path.join(tmp, "saved"))
    torch.distributed.barrier()
    back = PeftModel.from_pretrained(base_model(name), os.path.join(tmp, "saved")).eval()
    _close(back(ids).logits, ref(ids).logits, f"{name} save_adapter -> PeftModel")
    # an adapter saved by peft -> load_adapter onto a parallelized model (own init: B = 0)
    other = peft_model(name, seed=0)
    torch.manual_seed(7)
    for n, p in other.named_parameters():
        if "lora_" in n:
            p.data.normal_(0, 0.1)
    if rank == 0:
        other.save_pretrained(os.path.join(tmp, "peft"))
    torch.distributed.barrier()
    fresh = parallelize(peft_model(name, init_lora_weights=True))
    load_adapter(fresh, os.path.join(tmp, "peft"))
    _close(fresh(ids).logits, other(ids).logits, f"{name} load_adapter")
    # merge_adapters == peft's merge_and_unload
    merged = merge_adapters(m)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    unloaded = copy.deepcopy(ref).merge_and_unload()
    _close(merged(ids).logits, unloaded(ids).logits, f"{name} merge")
    # ... and consolidates into a plain HF directory (Inf2 inference) that transformers loads
    from transformers import AutoModelForCausalLM

    from neuron_tp.hf import save_pretrained

    save_pretrained(merged, os.path.join(tmp, "merged"))
    torch.distributed.barrier()
    plain = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "merged")).eval()
    _close(plain(ids).logits, unloaded(ids).logits, f"{name} merged -> save_pretrained")


def _raises(fn, *words: str) -> None:
    with pytest.raises(ValueError) as e:
        fn()
    assert all(w in str(e.value) for w in words), str(e.value)


def _check_refusals() -> None:
    from peft import IA3Config, get_peft_model

    name = "tiny-llama"
    _raises(lambda: parallelize(peft_model(name, use_dora=True)), "use_dora")
    m = peft_model(name, target_modules=["q_proj", "lm_head"])
    _raises(lambda: parallelize(m), "lm_head", "colwise")
    assert type(m.base_model.model.model.layers[0].self_attn.q_proj.base_layer).__name__ == "Linear"
    assert not is_parallel(m)
    _raises(lambda: parallelize(peft_model(name, target_modules=["embed_tokens"])), "Embedding")
    ia3 = get_peft_model(
        base_model(name), IA3Config(target_modules=["q_proj"], feedforward_modules=[])
    )
    _raises(lambda: parallelize(ia3), "LoRA")
    two = peft_model(name)
    two.add_adapter("second", lora_config(name))
    _raises(lambda: parallelize(two), "exactly one")
    inner = peft_model(name)
    _raises(lambda: parallelize(inner.base_model.model), "PeftModel")
    # the other order: peft's get_peft_model gets our refusal from the parallel layers
    with pytest.raises(UserError, match="wrap first, then parallelize"):
        get_peft_model(parallelize(base_model(name)), lora_config(name))


CASES = [
    "llama",
    "llama-sp",
    "llama-parallel-loss",
    "qwen3",
    "qwen3-sp",
    "gpt2",
    "gpt2-sp",
    "adapter-io-llama",
    "adapter-io-gpt2",
    "refusals",
]


def _case(case: str, tp: int, tmp: str) -> None:
    gloo_dist.shared_mesh(tp)
    if case == "refusals":
        _check_refusals()
    elif case.startswith("adapter-io-"):
        _check_adapter_io("tiny-" + case.removeprefix("adapter-io-"), tmp)
    else:
        name, _, mode = case.partition("-")
        _check_training("tiny-" + name, mode == "sp", mode == "parallel-loss")


# tp 4 replicates the kv heads (2) of Llama / Qwen3: the cases where that matters (SP once).
TP2_ONLY = ("llama-parallel-loss", "adapter-io-gpt2", "refusals", "qwen3-sp", "gpt2-sp")
CASES_TP4 = [c for c in CASES if c not in TP2_ONLY]


@pytest.mark.parametrize(
    "tp, case", [(2, c) for c in CASES] + [(4, c) for c in CASES_TP4], ids=lambda v: str(v)
)
def test_lora(tp, case, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "lora")
    cases = CASES if tp == 2 else CASES_TP4
    gloo_dist.run_case(_case, case, tp, tmp, cases=cases, world_size=tp)


ODD = ["odd-llama", "odd-llama-sp"]


def _odd_case(case: str) -> None:
    gloo_dist.shared_mesh(3)
    _check_training("odd-llama", case.endswith("-sp"), False)


@pytest.mark.parametrize("case", ODD)
def test_lora_tp3(case):
    gloo_dist.run_case(_odd_case, case, cases=ODD, world_size=3)


def test_lora_xla_tp2():
    import lora_xla_cases

    import xla_dist

    (r0, r1) = xla_dist.run(lora_xla_cases.job, devices=2)
    assert r0["checks"] == r1["checks"] and len(r0["checks"]) > 10

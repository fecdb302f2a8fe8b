"""``neuron-tp train --lora-r``: LoRA fine-tuning of a tensor-parallel model on 2 gloo ranks
(tp=2, with sequence parallelism) follows the unsharded peft model trained the same way step
by step (losses, adapter-gradient norms), only adapters train, and the adapters saved at the
end are PEFT's format: plain peft loads them onto the unsharded base with the reference's
weights. The same for a tiny Mixtral (MoE) directory with LoRA on its attention projections
(tp=2, no SP); LoRA on its fused 3-D experts is refused naming the valid targets."""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from train_cpu import losses as _losses  # noqa: E402
from train_cpu import quiet as _quiet  # noqa: E402
from train_cpu import train_args as _args  # noqa: E402

TARGETS = "q_proj,v_proj,o_proj,down_proj"  # column and row projections
LORA = ["--lora-r", "4", "--lora-alpha", "12", "--lora-target-modules", TARGETS]
STEPS = ["--steps", "30", "--micro-batch", "2", "--save-every", "0"]
HF_STEPS = ["--steps", "4", "--micro-batch", "2", "--save-every", "0"]
# a tiny Mixtral (MoE): LoRA on the attention projections only
MOE_LORA = ["--lora-r", "4", "--lora-alpha", "8", "--lora-target-modules", "q_proj,k_proj,o_proj"]
MOE_STEPS = ["--steps", "4", "--micro-batch", "2", "--save-every", "0", "--lr", "1e-2"]
ATTN = "k_proj,o_proj,q_proj,v_proj"  # the LoRA targets a Mixtral supports under tp


def _moe_refusals(moe_dir: str, tmp: str, mesh) -> None:
    """LoRA on the fused 3-D experts is refused, naming the valid targets, and the ranks go on
    (no collective was started: the next collective does not hang)."""
    import pytest
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from neuron_tp import hf
    from neuron_tp.errors import UserError
    from neuron_tp.train.loop import train

    model = tf.AutoModelForCausalLM.from_pretrained(moe_dir)
    cfg = LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"])
    with pytest.raises(ValueError, match=r"target_parameters \['experts.gate_up_proj'\].*"
                       r"target_modules \['k_proj', 'o_proj', 'q_proj', 'v_proj'\]"):  # fmt: skip
        hf.parallelize(get_peft_model(model, cfg), mesh)
    bad = ["--lora-r", "4", "--lora-target-modules", "q_proj,experts"]
    args = _args(f"{tmp}/bad", "--tp", "2", "--model", moe_dir, "--tokenizer", "bytes", *bad)
    with pytest.raises(
        UserError, match=f"MixtralExperts.*supports under tensor parallelism: {ATTN}"
    ):
        train(args, mesh=mesh, printer=_quiet)


def _lora_rank(tmp: str) -> None:
    from neuron_tp.train.loop import train
    from neuron_tp.train.peft_wrap import trainable_summary

    mesh = ntp.init_mesh(tp=2)
    runs = []
    args = _args(f"{tmp}/run", "--tp", "2", "--sequence-parallel", *LORA, *STEPS)
    summary = train(args, mesh=mesh, printer=_quiet, on_step=runs.append)
    model = runs[-1].model
    res = {
        "losses": _losses(summary),
        "norms": [e["grad_norm"] for e in summary["log"]],
        "params": trainable_summary(model),
        "optimizer_tensors": sum(
            t.numel()
            for st in runs[-1].optimizer.state.values()
            for t in st.values()
            if torch.is_tensor(t) and t.dim() > 0
        ),
    }
    # a local HF directory: the base read slice by slice onto the meta-device peft model
    from moe_archs import build_moe, loud_experts
    from neuron_tp.job.presets import build_model

    if mesh.rank == 0:
        build_model("tiny-llama", 257, 3).save_pretrained(f"{tmp}/hf")
        loud_experts(build_moe("mixtral", 5, vocab_size=257)).save_pretrained(f"{tmp}/moe")
    torch.distributed.barrier()
    hf = ["--model", f"{tmp}/hf", "--tokenizer", "bytes"]  # a directory without a tokenizer
    args = _args(f"{tmp}/run-hf", "--tp", "2", *hf, *LORA, *HF_STEPS)
    res["hf_losses"] = _losses(train(args, mesh=mesh, printer=_quiet))
    moe = ["--model", f"{tmp}/moe", "--tokenizer", "bytes"]
    _moe_refusals(f"{tmp}/moe", tmp, mesh)
    summary = train(_args(f"{tmp}/run-moe", "--tp", "2", *moe, *MOE_LORA, *MOE_STEPS), mesh=mesh,
                    printer=_quiet)  # fmt: skip
    res["moe_losses"] = _losses(summary)
    res["moe_norms"] = [e["grad_norm"] for e in summary["log"]]
    with open(f"{tmp}/lora-{mesh.rank}.json", "w") as fh:
        json.dump(res, fh)


def test_lora_training_follows_unsharded_peft_and_saves_a_peft_adapter(tmp_path):
    import transformers as tf
    from peft import PeftModel
    from safetensors.torch import load_file

    from neuron_tp.job.presets import build_model
    from reference_train import reference_run

    gloo_dist.run(_lora_rank, str(tmp_path), world_size=2)
    r0, r1 = (json.loads((tmp_path / f"lora-{r}.json").read_text()) for r in range(2))
    args = _args(tmp_path / "ref", *LORA, *STEPS)
    losses, norms = reference_run(args, global_micro_batch=2)
    assert r0["losses"] == r1["losses"]
    assert len(r0["losses"]) == 30
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(losses), atol=2e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(r0["norms"]), torch.tensor(norms), atol=2e-4, rtol=1e-3)
    assert losses[-1] < losses[0] - 0.05  # the adapters did learn something
    # only adapters train; every rank holds half of each sharded adapter
    params = r0["params"]
    assert 0 < params["trainable"] < params["total"] / 10
    assert r0["optimizer_tensors"] == 2 * params["trainable"]  # AdamW moments of adapters only
    # the saved adapters: PEFT's files, loadable by plain peft onto the unsharded base
    adapter = tmp_path / "run" / "adapter"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(adapter))
    base = build_model("tiny-llama", 257, 0)
    loaded = PeftModel.from_pretrained(base, str(adapter)).eval()
    ref = reference_run.model.eval()
    ids = torch.arange(1, 33)[None] % 250
    torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, atol=2e-4, rtol=1e-4)
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    assert len(saved) == 2 * 4 * 2  # A and B of 4 target modules x 2 layers
    # the same directory as a served adapter (neuron-tp serve --lora-modules NAME=DIR)
    from neuron_tp import hf, init_mesh
    from neuron_tp.hf.lora_bank import LoraBank, read_adapter

    served = hf.parallelize(build_model("tiny-llama", 257, 0), init_mesh(tp=1)).eval()
    bank = LoraBank(served, 2, 8)
    bank.write(1, read_adapter(str(adapter)))
    with torch.no_grad(), bank.bound(bank.tensors), bank.select(torch.tensor([1])):
        torch.testing.assert_close(served(ids).logits, ref(ids).logits, atol=2e-4, rtol=1e-4)
    hf_losses, _ = reference_run(
        _args(
            tmp_path / "ref-hf",
            "--model",
            str(tmp_path / "hf"),
            "--tokenizer",
            "bytes",
            *LORA,
            *HF_STEPS,
        ),
        2,
    )
    torch.testing.assert_close(
        torch.tensor(r0["hf_losses"]), torch.tensor(hf_losses), atol=2e-4, rtol=0
    )
    # the MoE model: losses and adapter-gradient norms of unsharded peft on plain transformers
    moe = ["--model", str(tmp_path / "moe"), "--tokenizer", "bytes"]
    losses, norms = reference_run(_args(tmp_path / "ref-moe", *moe, *MOE_LORA, *MOE_STEPS), 2)
    torch.testing.assert_close(
        torch.tensor(r0["moe_losses"]), torch.tensor(losses), atol=2e-4, rtol=0
    )
    torch.testing.assert_close(
        torch.tensor(r0["moe_norms"]), torch.tensor(norms), atol=2e-4, rtol=1e-3
    )
    adapter = tmp_path / "run-moe" / "adapter"
    base = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    loaded = PeftModel.from_pretrained(base, str(adapter)).eval()
    ref = reference_run.model.eval()
    torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, atol=2e-4, rtol=1e-4)
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    assert len(saved) == 2 * 3 * 2  # A and B of 3 attention projections x 2 layers
    assert all(t.abs().sum() > 0 for k, t in saved.items() if "lora_B" in k)  # trained

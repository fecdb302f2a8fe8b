"""int8 weights of MoE models (``neuron_tp.quantize`` / ``--quantize int8``), on 2 gloo ranks.

The reference is independent, in plain torch and fp32: the unsharded transformers model whose
nn.Linear weights (all but the LM head and the replicated 1-output shared-expert gate; none for
GPT-OSS, whose tiny attention neuron_tp keeps replicated, in float) and
whose fused expert weights (per expert, per output channel: the input dim is the last one, or
dim 1 when transformers declares the experts ``is_transposed``) are
``dequantize(quantize(W))``. Cases (one launch): Mixtral and Qwen2-MoE (shared expert, a dense
layer) through neuron_tp's MoE block, GPT-OSS (transposed, interleaved, biased experts)
through the experts interface, at tp 2; Mixtral at ep 2. Each: the expert weights are int8
buffers (no float copy), a down-projection shard equals the reference's slice bit for bit
(its scales are the full rows'), logits equal the reference's to fp32 rounding while the
quantization itself moves them much more, greedy tokens (neuron_tp's generator) equal
transformers' ``generate`` on the reference; saving is refused by name, re-quantizing too.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gloo_dist
from moe_archs import build_moe, loud_experts
from moe_families import build_family

PROMPTS = [[3, 14, 15, 9], [26, 5, 35, 8, 9, 7, 9]]
NEW = 6
POSITIONS = 256  # the generator's KV cache grows in steps of 128
FUSED = ("gate_up_proj", "up_proj", "down_proj")
CASES = ("mixtral_tp2", "qwen2_moe_tp2", "gpt_oss_tp2", "mixtral_ep2")


def _dq(w: torch.Tensor, in_dim: int) -> torch.Tensor:
    w = w.detach().float()
    s = w.abs().amax(dim=in_dim, keepdim=True) / 127
    return torch.round(w / s).clamp(-127, 127) * s


def reference(full: torch.nn.Module, linears: bool = True) -> torch.nn.Module:
    """``full`` with dequantized int8 experts (and linears, unless ``linears`` is False: a
    model whose linears stay replicated)."""
    ref = copy.deepcopy(full)
    with torch.no_grad():
        for name, mod in ref.named_modules():
            lin = isinstance(mod, torch.nn.Linear) and linears
            if lin and name != "lm_head" and mod.out_features > 1:
                mod.weight.copy_(_dq(mod.weight, 1))
            for pname in FUSED:
                p = mod._parameters.get(pname)
                if p is not None and p.dim() == 3:
                    p.copy_(_dq(p, 1 if getattr(mod, "is_transposed", False) else 2))
    return ref


def _build(case: str):
    family = case.rsplit("_", 1)[0]
    if family == "gpt_oss":
        return build_family(
            "gpt_oss", seed=1, max_position_embeddings=POSITIONS, sliding_window=POSITIONS
        )
    return loud_experts(build_moe(family, seed=1, max_position_embeddings=POSITIONS))


def _greedy_ref(ref):
    return [
        ref.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p) :].tolist()
        for p in PROMPTS
    ]


@torch.no_grad()
def _greedy_loop(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(NEW):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _check(case: str) -> None:
    import neuron_tp as ntp
    from neuron_tp.errors import UserError
    from neuron_tp.infer.static_generator import generate
    from neuron_tp.layers.quantized import Int8WeightLinear
    from neuron_tp.moe.quantized import quantized_experts

    mesh = ntp.init_mesh(tp=1, ep=2) if case.endswith("ep2") else gloo_dist.shared_mesh(2)
    full = _build(case)
    model = ntp.quantize(ntp.parallelize(copy.deepcopy(full), mesh), mesh).eval()
    # GPT-OSS's tiny attention stays replicated (float); its experts alone are sharded
    linears = not case.startswith("gpt_oss")
    assert any(isinstance(m, Int8WeightLinear) for m in model.modules()) == linears
    ref = reference(full, linears).eval()
    experts = [m for n, m in model.named_modules() if n.endswith("experts")]
    assert experts and set(quantized_experts(model)) >= {
        n for n, _ in model.named_modules() if n.endswith("experts")
    }
    for mod in experts:
        assert not any(n in FUSED for n, _ in mod.named_parameters()), mod
        assert mod.qdown_proj.dtype == torch.int8
    # a down shard (tp: its slice of every row; ep: its experts) == the reference's slice
    got_down, ref_experts = experts[0].down_proj, ref.get_submodule(_first_experts(model))
    want = ref_experts.down_proj.detach()
    if mesh.ep_size > 1:
        e = want.shape[0] // mesh.ep_size
        want = want[mesh.rank * e : (mesh.rank + 1) * e]
    elif not getattr(ref_experts, "is_transposed", False):
        i = want.shape[2] // mesh.tp_size
        want = want[:, :, mesh.tp_rank * i : (mesh.tp_rank + 1) * i]
    else:
        i = want.shape[1] // mesh.tp_size
        want = want[:, mesh.tp_rank * i : (mesh.tp_rank + 1) * i]
    assert torch.equal(got_down, want), (got_down - want).abs().max()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        got, exp, plain = (m(ids).logits for m in (model, ref, full))
    err, moved = (got - exp).abs().max().item(), (got - plain).abs().max().item()
    assert err < 2e-5 and moved > 100 * max(err, 1e-7), (err, moved)
    if linears:
        assert generate(model, PROMPTS, NEW, [8]) == _greedy_ref(ref)
    else:  # neuron_tp's generator differs from transformers on float GPT-OSS too: full passes
        assert [_greedy_loop(model, p) for p in PROMPTS] == _greedy_ref(ref)
    with pytest.raises(UserError, match="already quantized"):
        ntp.quantize(model, mesh)
    with pytest.raises(UserError, match="experts hold int8 weights"):
        ntp.save_pretrained(model, "/nonexistent/never-written", mesh)


def _first_experts(model) -> str:
    return next(n for n, _ in model.named_modules() if n.endswith("experts"))


@pytest.mark.parametrize("case", CASES)
def test_int8_moe_matches_dequantized_reference(case):
    gloo_dist.run_case(_check, case, cases=CASES, world_size=2)


def test_quantize_int8_on_load_and_checkpoint_refusal(tmp_path, capsys):
    """``--quantize int8`` on a float Mixtral directory (one process): experts loaded int8,
    greedy tokens of the reference; ``consolidate --quantize int8`` refuses the model by name
    and writes no weights."""
    import neuron_tp as ntp
    from neuron_tp.checkpoint.int8_export import consolidate_int8
    from neuron_tp.cli.args import generate_parser
    from neuron_tp.errors import UserError
    from neuron_tp.infer.load import load_for_generation
    from neuron_tp.infer.static_generator import generate
    from neuron_tp.moe.quantized import quantized_experts

    full = loud_experts(build_moe("mixtral", seed=2, vocab_size=257, max_position_embeddings=256))
    full.save_pretrained(tmp_path / "model")
    argv = ["--device", "cpu", "--model", str(tmp_path / "model"), "--tokenizer", "bytes"]
    model, _ = load_for_generation(
        generate_parser().parse_args([*argv, "--quantize", "int8"]), ntp.Mesh(1, 0)
    )
    assert quantized_experts(model) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert "2 experts modules quantized to int8" in capsys.readouterr().out
    assert generate(model, PROMPTS, NEW, [8]) == _greedy_ref(reference(full).eval())
    with pytest.raises(UserError, match=r"model\.layers\.0\.mlp\.experts.*int8 linears only"):
        consolidate_int8(str(tmp_path / "model"), str(tmp_path / "int8"))
    assert not (tmp_path / "int8" / "model.safetensors").exists()


def test_xla_two_devices_int8_mixtral():
    """tp 2 on 2 XLA CPU devices: the reference's logits, experts int8 on the device, and the
    bf16 graph reads its expert and linear weights as int8 (+ bf16 scales)."""
    from xla_moe_int8_cases import moe_int8_rank

    import xla_dist

    reps = xla_dist.run(moe_int8_rank, PROMPTS[1], devices=2)
    for rep in reps:
        print({k: rep[k] for k in ("err_ref", "err_unquantized", "bytes_bf16", "bytes_int8")})
        assert rep["int8_on_device"]
        assert rep["err_ref"] < 1e-4 and rep["err_unquantized"] > 10 * rep["err_ref"], rep
        assert rep["int8_dtypes"] == ["bf16", "s8"], rep
        assert 0.5 < rep["bytes_int8"] / rep["bytes_bf16"] <= 0.6, rep

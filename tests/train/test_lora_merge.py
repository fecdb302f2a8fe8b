"""A LoRA run (``neuron-tp train --lora-r``, base a tiny Llama directory, gloo tp 2 and tp 4)
used as a model: ``consolidate`` writes the merged plain model (transformers loads it with no
missing key; logits equal peft's ``merge_and_unload`` of the base with the adapter the run
wrote) or, with ``--adapter-only``, PEFT's adapter directory; ``neuron-tp generate`` on the
run's output directory, and on the base with ``--adapter``, gives the tokens transformers'
``generate`` gives on the merged model: gloo tp 2, tp 4 (the tp-2 run resharded) and 2 XLA
CPU devices. peft's ``get_peft_model`` on a parallelized model gets our refusal."""

from __future__ import annotations

import json
import os
import sys

import peft  # noqa: F401  (imported before the XLA device threads start)
import pytest
import torch
import transformers  # noqa: F401

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from train_cpu import quiet as _quiet  # noqa: E402
from train_cpu import train_args as _args  # noqa: E402

LORA = [
    "--lora-r",
    "4",
    "--lora-alpha",
    "12",
    "--lora-target-modules",
    "q_proj,v_proj,o_proj,down_proj",
]
TRAIN = [
    "--tokenizer",
    "bytes",
    "--micro-batch",
    "2",
    "--save-every",
    "0",
    "--lr",
    "1e-2",
    "--warmup-steps",
    "0",
]
PROMPTS = ["The old", "A"]
NEW = 6


def _generate(model: str, tp: int, device: str, *extra: str) -> list[str]:
    from neuron_tp.cli.args import generate_parser
    from neuron_tp.infer.generate_command import run_cli

    argv = ["--device", device, "--tp", str(tp), "--model", model, "--max-new-tokens", str(NEW)]
    argv += ["--buckets", "8", *(a for p in PROMPTS for a in ("--prompt", p)), *extra]
    return run_cli(generate_parser().parse_args(argv))


def _both(tmp: str, tp: int, device: str) -> dict:
    """Generation from the tp-2 run's output directory and from the base with --adapter."""
    return {
        "run": _generate(f"{tmp}/run2", tp, device),
        "adapter": _generate(
            f"{tmp}/base", tp, device, "--adapter", f"{tmp}/run2/adapter", "--tokenizer", "bytes"
        ),
    }


def _rank(tmp: str, tp: int) -> None:
    from neuron_tp.job.presets import build_model
    from neuron_tp.train.loop import train

    mesh = ntp.init_mesh(tp=tp)
    if tp == 2 and mesh.rank == 0:
        build_model("tiny-llama", 257, 3).save_pretrained(f"{tmp}/base")
    torch.distributed.barrier()
    steps = ["--steps", "3" if tp == 2 else "2"]
    args = _args(f"{tmp}/run{tp}", "--tp", str(tp), "--model", f"{tmp}/base", *LORA, *TRAIN, *steps)
    train(args, mesh=mesh, printer=_quiet)
    res = _both(tmp, tp, "cpu")
    if tp == 2:  # our refusal of peft wrapping an already parallelized model
        from peft import LoraConfig, get_peft_model

        plain = ntp.hf.parallelize(build_model("tiny-llama", 257, 3), mesh)
        try:
            get_peft_model(plain, LoraConfig(r=4, target_modules=["q_proj"]))
            res["refusal"] = None
        except ValueError as e:
            res["refusal"] = str(e)
    with open(f"{tmp}/gen{tp}-{mesh.rank}.json", "w") as fh:
        json.dump(res, fh)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> str:
    tmp = str(tmp_path_factory.mktemp("lora-merge"))
    gloo_dist.run(_rank, tmp, 2, world_size=2)
    gloo_dist.run(_rank, tmp, 4, world_size=4)
    return tmp


def _reference(tmp: str, adapter: str):
    """peft's merge_and_unload of the unsharded base carrying ``adapter`` (and the base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(f"{tmp}/base").eval()
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
    return merged, AutoModelForCausalLM.from_pretrained(f"{tmp}/base").eval()


IDS = torch.arange(1, 33)[None] % 250


@pytest.mark.parametrize("tp", [2, 4])
def test_consolidate_lora_run_writes_the_merged_plain_model(runs, tp, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from neuron_tp.cli.entry import main

    assert main(["consolidate", f"{runs}/run{tp}", str(tmp_path / "merged")]) == 0
    plain, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), output_loading_info=True
    )
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    ref, base = _reference(runs, f"{runs}/run{tp}/adapter")
    keys = set(load_file(str(tmp_path / "merged" / "model.safetensors")))
    assert keys == set(base.state_dict()), keys ^ set(base.state_dict())
    with torch.no_grad():
        got, want, before = plain.eval()(IDS).logits, ref(IDS).logits, base(IDS).logits
    assert (want - before).abs().max() > 1e-2  # the adapter changes the model
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_consolidate_adapter_only_writes_the_peft_adapter(runs, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from neuron_tp.cli.entry import main

    out = tmp_path / "adapter"
    assert main(["consolidate", "--adapter-only", f"{runs}/run2", str(out)]) == 0
    got = load_file(str(out / "adapter_model.safetensors"))
    want = load_file(f"{runs}/run2/adapter/adapter_model.safetensors")
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(f"{runs}/base")
    loaded = PeftModel.from_pretrained(base, str(out)).eval()
    ref, _ = _reference(runs, f"{runs}/run2/adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, ref(IDS).logits, atol=1e-5, rtol=1e-5)


def _hf_texts(tmp: str, merge: bool = True) -> list[str]:
    """transformers' greedy generate on the merged unsharded model (or the base), decoded by
    the run's (byte-level) tokenizer."""
    from neuron_tp.infer.load import eos_ids
    from neuron_tp.job.data import load_tokenizer

    tok = load_tokenizer(None)
    merged, base = _reference(tmp, f"{tmp}/run2/adapter")
    merged = merged if merge else base
    stops = eos_ids(merged, tok)
    texts = []
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        out = merged.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        new = out[0, ids.shape[1] :].tolist()  # up to the first EOS (as serve, not decoded)
        new = new[: next((i for i, t in enumerate(new) if t in stops), len(new))]
        texts.append(tok.decode(new))
    return texts


@pytest.mark.parametrize("tp", [2, 4])
def test_generate_merges_a_lora_run_or_an_adapter_on_load(runs, tp):
    results = [json.loads(open(f"{runs}/gen{tp}-{r}.json").read()) for r in range(tp)]
    assert all(r == results[0] for r in results)
    want = _hf_texts(runs)
    assert want != _hf_texts(runs, merge=False)  # the adapter changes the tokens
    assert results[0]["run"] == want
    assert results[0]["adapter"] == want


def test_get_peft_model_on_a_parallelized_model_is_refused_with_the_order(runs):
    msg = json.loads(open(f"{runs}/gen2-0.json").read())["refusal"]
    assert msg is not None and "wrap first, then parallelize" in msg, msg
    assert "ntp.parallelize(get_peft_model(model, cfg), mesh)" in msg, msg


def _xla_job(tmp: str) -> dict:
    return _both(tmp, 2, "xla")


def test_generate_lora_on_xla_cpu_devices(runs):
    import xla_dist

    r0, r1 = xla_dist.run(_xla_job, runs, devices=2)
    want = _hf_texts(runs)
    assert r0 == r1
    assert r0["run"] == want and r0["adapter"] == want

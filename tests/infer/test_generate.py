"""Generation: on 2 gloo ranks (tp=2) greedy tokens equal transformers' own ``generate`` on
the unsharded model, sampled tokens are identical on every rank and equal transformers'
``generate(do_sample=True)`` on the unsharded model for the same seed, and ``neuron-tp
generate`` on a saved model directory prints the same text; on the XLA CPU device the number
of compiled graphs does not grow with the number of generated tokens (one more prefill graph
per new bucket) and tokens equal eager CPU."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from hf_sampling import hf_sample, peaked  # noqa: E402

HERE = os.path.dirname(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
PROMPTS = [[72, 101, 108], [84, 104, 101, 32, 111, 108, 100], list(range(97, 108))]
EOS = [131, 215]  # seed-4 tiny Llama: ends row 0 after 3 tokens, row 1 after 6, not row 2


def _sharded(tmp: str) -> None:
    from neuron_tp import hf
    from neuron_tp.cli.args import generate_parser
    from neuron_tp.infer.generate_command import run_cli
    from neuron_tp.infer.static_generator import generate
    from neuron_tp.job.presets import build_model

    mesh = ntp.init_mesh(tp=2)
    full = build_model("tiny-llama", 257, 4).eval()
    model = hf.parallelize(copy.deepcopy(full), mesh).eval()
    peak = peaked(copy.deepcopy(full))  # logits spread over units: the temperature matters
    peak_sharded = hf.parallelize(copy.deepcopy(peak), mesh).eval()
    res = {
        "greedy": generate(model, PROMPTS, 10, [8, 16]),
        "ref_greedy": [
            full.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in PROMPTS
        ],
        "sample": generate(
            peak_sharded, PROMPTS, 10, [16], do_sample=True, temperature=0.8, top_k=20, seed=9
        ),
        "ref_sample": hf_sample(peak, PROMPTS, 10, temperature=0.8, top_k=20, seed=9),
        "peak_greedy": generate(peak_sharded, PROMPTS, 10, [16]),
    }
    # one batch bucket of 4 (a filler row) with per-sequence EOS, and stop strings
    from neuron_tp.infer.static_generator import Generator

    gen = Generator(model, [16], 20, batch_buckets=[4])
    res["eos"] = gen.generate(PROMPTS, 20, eos_ids=EOS)
    res["ref_eos"] = [
        full.generate(
            torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=EOS, pad_token_id=0
        )[0, len(p) :].tolist()
        for p in PROMPTS
    ]
    hf.save_pretrained(model, f"{tmp}/model")  # rank 0 writes: wait for it
    torch.distributed.barrier()
    args = generate_parser().parse_args(
        [
            "--device",
            "cpu",
            "--tp",
            "2",
            "--model",
            f"{tmp}/model",
            "--tokenizer",
            "bytes",  # the saved directory holds no tokenizer
            "--prompt",
            "The old",
            "--prompt",
            "A",
            "--max-new-tokens",
            "6",
            "--buckets",
            "8",
        ]
    )
    res["cli"] = run_cli(args)
    res["cli_ref"] = [
        bytes(t for t in o if t < 256).decode("utf-8", "replace")
        for o in generate(full, [list(b"The old"), list(b"A")], 6, [8], eos_ids=[256])
    ]
    stop = res["cli_ref"][0][1:3]  # a stop string that occurs in the first continuation
    args.stop = [stop]
    res["cli_stop"] = run_cli(args)
    res["cli_stop_ref"] = [t[: t.find(stop)] if stop in t else t for t in res["cli_ref"]]
    with open(f"{tmp}/gen-{mesh.rank}.json", "w") as fh:
        json.dump(res, fh)


def test_sharded_generation_matches_unsharded(tmp_path):
    gloo_dist.run(_sharded, str(tmp_path), world_size=2)
    r0, r1 = (json.loads((tmp_path / f"gen-{r}.json").read_text()) for r in range(2))
    assert r0 == r1  # every tp rank produced the same tokens
    assert r0["greedy"] == r0["ref_greedy"]
    assert r0["sample"] == r0["ref_sample"] and r0["sample"] != r0["peak_greedy"]
    assert r0["cli"] == r0["cli_ref"]
    assert r0["cli_stop"] == r0["cli_stop_ref"] and r0["cli_stop"] != r0["cli"]
    assert r0["eos"] == r0["ref_eos"] and sorted(map(len, r0["eos"])) == [3, 6, 20]


def test_xla_graph_count_does_not_grow_with_tokens():
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "xla_generate_run.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))[4:])
    c = rep["compiles"]
    assert c[0] == 2  # one prefill graph (bucket 8) and one decode graph
    assert c[1] == c[0]  # 24 tokens instead of 4: no new graph
    assert c[2] == c[1] + 1  # a longer prompt: one prefill graph for the new bucket
    assert c[3] == c[2]
    assert all(rep["equal"])


# Families whose tiny models ``neuron-tp generate`` runs at tp 2 against transformers' generate:
# sliding and global layers (Gemma-3), a projected decoder with biases (OPT), Seed-OSS, and
# GPT-OSS (eager attention with sinks, experts: the 4-D mask must be additive for eager).
GEN_FAMILIES = ("gemma3_text", "opt", "seed_oss", "gpt_oss")
GEN_PROMPTS = ["The old", "A"]
WIDE = 512  # positions and sliding windows: every layer's static cache holds the whole sequence


def _family_model(mt: str):
    from dense_families import build_dense
    from moe_families import build_family

    sizes = dict(vocab_size=257, max_position_embeddings=WIDE)  # the byte tokenizer's ids
    if mt == "gpt_oss":
        return build_family(mt, seed=1, sliding_window=WIDE, **sizes)
    return build_dense(mt, seed=1, **sizes, **({} if mt == "opt" else {"sliding_window": WIDE}))


def _families(tmp: str) -> None:
    import transformers as tf

    from neuron_tp.cli.args import generate_parser
    from neuron_tp.infer.generate_command import run_cli

    out = {}
    for mt in GEN_FAMILIES:
        path = f"{tmp}/{mt}"
        if torch.distributed.get_rank() == 0:
            _family_model(mt).save_pretrained(path)
        torch.distributed.barrier()
        ref = tf.AutoModelForCausalLM.from_pretrained(path).eval()
        want = []
        for p in GEN_PROMPTS:
            ids = torch.tensor([list(p.encode())])
            toks = ref.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=256)
            new = bytes(t for t in toks[0, ids.shape[1] :] if t < 256)
            want.append(new.decode("utf-8", "replace"))
        argv = ["--device", "cpu", "--tp", "2", "--model", path, "--tokenizer", "bytes"]
        argv += ["--max-new-tokens", "8", "--buckets", "8"]
        argv += [a for p in GEN_PROMPTS for a in ("--prompt", p)]
        out[mt] = {"got": run_cli(generate_parser().parse_args(argv)), "want": want}
    with open(f"{tmp}/families-{torch.distributed.get_rank()}.json", "w") as fh:
        json.dump(out, fh)


def test_family_generation_matches_transformers(tmp_path):
    """``neuron-tp generate`` (tp 2, the byte tokenizer) on each of :data:`GEN_FAMILIES`'
    tiny saved models: the greedy text equals transformers' ``generate`` on the same files."""
    gloo_dist.run(_families, str(tmp_path), world_size=2, timeout=600)
    r0, r1 = (json.loads((tmp_path / f"families-{r}.json").read_text()) for r in range(2))
    assert r0 == r1
    bad = {mt: r for mt, r in r0.items() if r["got"] != r["want"]}
    assert not bad, bad
    assert all(any(r["want"]) for r in r0.values())  # something was generated

"""lm-evaluation-harness against ``neuron-tp serve``, as users run it: its ``local-completions``
model (the OpenAI completions API; a multiple-choice task sends ``echo: true, logprobs: 1,
max_tokens: 1`` with token-id prompts) on a multiple-choice task and a generate_until task,
compared with lm-eval's own ``hf`` backend on the same model directory: the same accuracy, and
every choice's log-likelihood within 2e-3. The task and its data are local files; the model is
a tiny random Llama with a real HF tokenizer (examples/sft/tokenizer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

from http_app import free_port as _free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(REPO, "examples", "sft", "tokenizer")
QUESTIONS = [
    ("The capital of France is", ["Paris", "a cat", "blue"], 0),
    ("Two plus two equals", ["four", "seven", "a tree"], 0),
    ("The sky is usually", ["green", "blue", "loud"], 1),
    ("Ice is made of frozen", ["fire", "sand", "water"], 2),
    ("A week has seven", ["days", "moons", "cars"], 0),
    ("Bees make", ["steel", "honey", "glass"], 1),
]
TASKS = """
task: ntp_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """
task: ntp_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _model_dir(path: str) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _evaluate(model: str, model_args: str, tasks_dir: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["ntp_mc", "ntp_gen"],
        task_manager=TaskManager(include_path=tasks_dir),
        log_samples=True,
        batch_size=1,
    )


def _choice_logliks(result: dict) -> list[list[float]]:
    samples = sorted(result["samples"]["ntp_mc"], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def test_lm_eval_local_completions_equals_its_hf_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    data = tmp_path / "qa.jsonl"
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "ntp_mc.yaml").write_text(TASKS.format(data=data))
    (tasks / "ntp_gen.yaml").write_text(GEN_TASK.format(data=data))
    model = _model_dir(str(tmp_path / "model"))

    port = _free_port()
    cmd = [sys.executable, "-m", "neuron_tp.cli", "serve", "--model", model, "--device", "cpu"]
    cmd += ["--port", str(port), "--served-model-name", "tiny", "--buckets", "32,64"]
    cmd += ["--max-new-tokens", "16"]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "the server did not get ready"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ready":
                        break
            except OSError:
                pass
            time.sleep(0.5)
        args = f"base_url=http://127.0.0.1:{port}/v1/completions,model=tiny,tokenizer={model}"
        args += ",tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=64"
        served = _evaluate("local-completions", args, str(tasks))
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    ref = _evaluate("hf", f"pretrained={model},dtype=float32,device=cpu", str(tasks))

    got, want = _choice_logliks(served), _choice_logliks(ref)
    assert len(got) == len(QUESTIONS) and all(len(g) == 3 for g in got), got
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
    print(f"lm-eval: largest per-choice log-likelihood difference {worst:.2e}")
    assert worst < 2e-3, (got, want)
    assert served["results"]["ntp_mc"]["acc,none"] == ref["results"]["ntp_mc"]["acc,none"]
    gen = sorted(served["samples"]["ntp_gen"], key=lambda s: s["doc_id"])
    gen_ref = sorted(ref["samples"]["ntp_gen"], key=lambda s: s["doc_id"])
    assert [s["resps"] for s in gen] == [s["resps"] for s in gen_ref]  # greedy, token for token

"""The preference runs of test_preference_train.py on 2 XLA CPU devices, in one launch
(``xla_dist.run_cases(on_two, list(CASES), base, devices=2)``): each case is
``neuron_tp.train.loop.train`` on the test's pairs with TRL's settings."""

from __future__ import annotations

import xla_multi_train_cases as cases

import preference_reference as ref

EVAL = ["--eval-data", "{base}/eval_pairs.jsonl", "--eval-every", "1"]
# case: (tp, cp, pp, our extra options)
CASES = {
    "dpo": (2, 1, 1, ["--steps", "4"]),
    "dpo-sp-eval": (2, 1, 1, ["--sequence-parallel", *EVAL]),
    "dpo-cp-eval": (1, 2, 1, ["--cp", "2", *EVAL]),
    "dpo-pp-eval": (1, 1, 2, ["--pp", "2", "--micro-batch", "2", "--grad-accum", "2", *EVAL]),
    "dpo-copy": (2, 1, 1, ["--reference", "copy"]),
    # a tiny Mixtral, its experts over 2 data-parallel ranks (2 pairs each)
    "dpo-moe-ep": (1, 1, 1, ["--model", "{base}/moe", "--ep", "2", "--micro-batch", "2"]),
}


def on_two(name: str, base: str) -> dict:
    """One rank of case ``name`` (see :data:`CASES`)."""
    tp, cp, pp, extra = CASES[name]
    argv = ["--micro-batch", "4", "--data", f"{base}/pairs.jsonl", "--tokenizer", f"{base}/tok"]
    argv += [*ref.ARGS, "--objective", "dpo", *(x.format(base=base) for x in extra)]
    ep = int(extra[extra.index("--ep") + 1]) if "--ep" in extra else 1
    return cases.run_train(tp, f"{base}/xla-{name}", argv, cp=cp, pp=pp, ep=ep)

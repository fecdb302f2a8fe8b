"""``OUTPUT_DIR/metrics.jsonl``: one JSON object per logged step, written by rank 0, one
flushed line at a time. A resumed run keeps the lines up to the step it resumed from and drops
the later ones (steps it is about to redo), so no step appears twice."""

from __future__ import annotations

import json
import os

METRICS_FILE = "metrics.jsonl"
KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "skipped_steps")
EVAL_KEYS = ("eval_loss", "eval_perplexity")
DPO_KEYS = (  # --objective dpo (neuron_tp.train.preference), TRL's names
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
ORPO_KEYS = (*DPO_KEYS, "nll_loss", "log_odds_ratio", "log_odds_chosen")
EVAL_PAIR_KEYS = tuple(f"eval_{k}" for k in ORPO_KEYS)  # --eval-data of pairs


def metrics_path(output_dir: str) -> str:
    return os.path.join(output_dir, METRICS_FILE)


class MetricsFile:
    """Appends entries to ``output_dir/metrics.jsonl`` after dropping those past ``step``."""

    def __init__(self, output_dir: str, step: int):
        self.path = metrics_path(output_dir)
        kept = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                    except json.JSONDecodeError:  # a line cut by a kill: dropped
                        continue
                    if isinstance(entry, dict) and entry.get("step", step + 1) <= step:
                        kept.append(line if line.endswith("\n") else line + "\n")
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")  # noqa: SIM115 - open for the run, closed by close()

    def write(self, entry: dict) -> None:
        """One line of ``entry``'s metrics (the keys of :data:`KEYS`, :data:`EVAL_KEYS`,
        :data:`ORPO_KEYS` and :data:`EVAL_PAIR_KEYS`)."""
        keys = (*KEYS, *EVAL_KEYS, *ORPO_KEYS, *EVAL_PAIR_KEYS)
        line = {k: entry[k] for k in keys if k in entry}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

"""Build the fine-tuning example in examples/sft/ offline (deterministic, no downloads):
``tokenizer/`` (a byte-level BPE trained on data/corpus.txt, with a chat template whose
assistant turns are marked for the loss) and two small instruction sets whose prompts are
random and whose answers follow from the prompt: ``chat.jsonl`` (``messages``, some with a
system message, some with two assistant turns) and ``prompt_completion.jsonl``.

    python scripts/build_sft_example.py [OUT_DIR]      # default examples/sft
"""

from __future__ import annotations

import json
import os
import random
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "helpers"))
from tiny_tokenizer import CHAT_TEMPLATE, bpe_tokenizer_dir  # noqa: E402

WORDS = "river stone cloud lamp garden window paper bridge forest candle".split()


def _task(rng: random.Random) -> tuple[str, str]:
    """A random prompt and the answer that follows from it."""
    word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 8)))
    kind = rng.randrange(3)
    if kind == 0:
        return f"Reverse the letters of {word}.", word[::-1]
    if kind == 1:
        return f"Spell {word} in capitals.", word.upper()
    a, b = rng.choice(WORDS), rng.choice(WORDS)
    return f"Join {a} and {b} with a dash.", f"{a}-{b}"


def build(out: str, n_chats: int = 400, n_pairs: int = 400, seed: int = 0) -> None:
    rng = random.Random(seed)
    bpe_tokenizer_dir(os.path.join(out, "tokenizer"), 512, CHAT_TEMPLATE)
    with open(os.path.join(out, "chat.jsonl"), "w") as f:
        for i in range(n_chats):
            system = {"role": "system", "content": "Answer with the result only."}
            messages = [system] * (i % 3 == 0)
            for _ in range(1 + (i % 4 == 0)):  # every fourth chat has two turns
                q, a = _task(rng)
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": messages}) + "\n")
    with open(os.path.join(out, "prompt_completion.jsonl"), "w") as f:
        for _ in range(n_pairs):
            q, a = _task(rng)
            f.write(json.dumps({"prompt": f"Q: {q}\nA: ", "completion": a}) + "\n")


if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "examples", "sft"))

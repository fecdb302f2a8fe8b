"""Preference pairs (``--objective dpo|orpo``) as padded rows: TRL's formats, jsonl lines
(or table rows) of

* ``{"prompt": str, "chosen": str, "rejected": str}``: the prompt encoded with the tokenizer's
  special tokens, each completion after it, ending with EOS;
* ``{"chosen": [messages], "rejected": [messages]}``: the prompt is their common prefix of
  messages, or an explicit ``{"prompt": [messages], "chosen": [...], "rejected": [...]}``;
  rendered with the chat template, the completion tokens are those of the messages after
  the prompt (found as :mod:`.chat` finds answers).

One pair is two rows of ``seq_len``, never packed: ``input_ids``/``labels``/``attention_mask``
(chosen) and ``rejected_*`` (rejected), labels -100 outside the completion, and
``pair_index`` (the pair's place in the data: where its reference log-probabilities are
kept). A pair whose prompt leaves no completion token within ``seq_len`` is refused, as is a
malformed line, naming ``file:line``, before training.
"""

from __future__ import annotations

import hashlib

import torch

from ..errors import UserError
from .chat import encode, encode_chat, template_of
from .data import RowData, data_files
from .rows import IGNORE_INDEX
from .samples import check_messages, jsonl_rows
from .sft_data import pad_id
from .tables import is_table, table_rows

SHAPE = (
    "{'prompt': str, 'chosen': str, 'rejected': str}, {'chosen': [messages], 'rejected': "
    "[messages]} or {'prompt': [messages], 'chosen': [messages], 'rejected': [messages]}"
)


def _messages_pair(obj: dict, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen completion, rejected completion) messages of a conversational pair."""
    chosen = check_messages(obj["chosen"], where, "chosen")
    rejected = check_messages(obj["rejected"], where, "rejected")
    if "prompt" in obj:
        return check_messages(obj["prompt"], where, "prompt"), chosen, rejected
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if k == 0:
        raise UserError(
            f"{where}: 'chosen' and 'rejected' share no first message, so there is no "
            "implicit prompt; add a 'prompt' list of messages"
        )
    if k == len(chosen) or k == len(rejected):
        raise UserError(f"{where}: 'chosen' or 'rejected' has no message after the prompt")
    return chosen[:k], chosen[k:], rejected[k:]


def encode_pair(obj: object, tokenizer, where: str) -> tuple[tuple, tuple]:
    """``((ids, mask), (ids, mask))`` of the chosen and rejected sequences of one line,
    ``mask``: the completion tokens."""
    if not isinstance(obj, dict) or not {"chosen", "rejected"} <= set(obj):
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise UserError(f"{where}: expected a preference pair {SHAPE}; got {keys}")
    c, r = obj["chosen"], obj["rejected"]
    if isinstance(c, str) and isinstance(r, str):
        prompt_text = obj.get("prompt")
        if not isinstance(prompt_text, str):
            raise UserError(f"{where}: string 'chosen'/'rejected' need a string 'prompt'")
        prompt = encode(tokenizer, prompt_text, special=True)
        eos = getattr(tokenizer, "eos_token_id", None)
        out = []
        for text in (c, r):
            answer = encode(tokenizer, text, special=False) + ([eos] if eos is not None else [])
            out.append((prompt + answer, [False] * len(prompt) + [True] * len(answer)))
        return out[0], out[1]
    if isinstance(c, list) and isinstance(r, list):
        prompt_msgs, chosen, rejected = _messages_pair(obj, where)
        template_of(tokenizer)
        out = []
        for completion in (chosen, rejected):
            msgs = prompt_msgs + completion
            answers = set(range(len(prompt_msgs), len(msgs)))
            out.append(encode_chat(tokenizer, msgs, answers, where))
        return out[0], out[1]
    raise UserError(
        f"{where}: 'chosen' and 'rejected' must be two strings or two lists of messages, got "
        f"{type(c).__name__} and {type(r).__name__}"
    )


def _row(ids: list[int], mask: list[bool], seq_len: int, pad: int):
    ids, mask = ids[:seq_len], mask[:seq_len]
    n = len(ids)
    row = torch.full((seq_len,), pad, dtype=torch.long)
    row[:n] = torch.tensor(ids, dtype=torch.long)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    labels[:n] = row[:n]
    labels[:n][~torch.tensor(mask, dtype=torch.bool)] = IGNORE_INDEX
    labels[0] = IGNORE_INDEX  # never predicted
    attention = torch.zeros((seq_len,), dtype=torch.long)
    attention[:n] = 1
    return row, labels, attention


def pair_rows(path: str, tokenizer, seq_len: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The rows of every pair at ``path`` (see the module) and a line for the startup log."""
    pad = pad_id(tokenizer)
    cols: dict[str, list[torch.Tensor]] = {
        k: []
        for k in (
            "input_ids",
            "labels",
            "attention_mask",
            "rejected_input_ids",
            "rejected_labels",
            "rejected_attention_mask",
        )
    }
    truncated = 0
    for f in data_files(path):
        for where, obj in table_rows(f) if is_table(f) else jsonl_rows(f):
            (c_ids, c_mask), (r_ids, r_mask) = encode_pair(obj, tokenizer, where)
            for prefix, ids, mask in (("", c_ids, c_mask), ("rejected_", r_ids, r_mask)):
                if not any(mask[1:seq_len]):
                    raise UserError(
                        f"{where}: the {prefix.rstrip('_') or 'chosen'} completion has no "
                        f"token within --seq-len {seq_len} (the prompt is "
                        f"{mask.index(True) if True in mask else len(ids)} tokens); shorten "
                        "the prompt, raise --seq-len or leave the line out"
                    )
                truncated += len(ids) > seq_len
                row, labels, attention = _row(ids, mask, seq_len, pad)
                cols[prefix + "input_ids"].append(row)
                cols[prefix + "labels"].append(labels)
                cols[prefix + "attention_mask"].append(attention)
    if not cols["input_ids"]:
        raise UserError(f"--data {path!r}: no preference pairs")
    rows = {k: torch.stack(v) for k, v in cols.items()}
    n = len(rows["input_ids"])
    rows["pair_index"] = torch.arange(n)
    note = f"data: {n} preference pairs, 2 padded rows of {seq_len} each"
    note += f"; {truncated} sequences longer than --seq-len truncated" if truncated else ""
    return rows, [note]


def rows_checksum(rows: dict[str, torch.Tensor]) -> str:
    """A digest of the pairs' tokens and completion masks (what a stored reference is of)."""
    h = hashlib.sha256()
    for k in sorted(rows):
        h.update(k.encode())
        h.update(rows[k].numpy().tobytes())
    return h.hexdigest()[:32]


def load_pairs(
    path: str,
    tokenizer,
    seq_len: int,
    micro_batch: int,
    *,
    dp_size: int = 1,
    dp_rank: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    cache: str | None = None,
) -> RowData:
    """This dp rank's batches of ``micro_batch`` pairs (:func:`pair_rows`); ``shuffle=False``:
    file order (evaluation); ``cache``: the ``--data-cache`` directory (None: no cache)."""
    from .data_cache import rows_of

    options = {"rows": "preference pairs", "seq_len": seq_len}
    rows, notes = rows_of(
        cache, path, tokenizer, options, lambda: pair_rows(path, tokenizer, seq_len)
    )
    data = RowData(
        rows,
        seq_len,
        micro_batch,
        dp_size=dp_size,
        dp_rank=dp_rank,
        seed=seed,
        shuffle=shuffle,
        what=f"{path}: ",
    )
    data.notes = notes
    return data

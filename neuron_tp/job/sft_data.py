"""The training data of a run, whatever its format (:mod:`.samples`): raw text streams as
language modelling (:func:`~.data.stream_rows`); instruction data (``messages``,
``prompt``/``completion``) as samples with their loss masks (:mod:`.chat`), fitted to
``--seq-len`` and packed (or padded, ``--no-packing``) into rows (:mod:`.rows`); tokenized once
per node with ``--data-cache`` (:mod:`.data_cache`)."""

from __future__ import annotations

import torch

from ..errors import UserError
from .chat import encode_record
from .data import RowData, stream_rows
from .rows import IGNORE_INDEX, fit, pack, pad
from .samples import TEXT, read_records


def pad_id(tokenizer) -> int:
    """The id padding uses: the tokenizer's pad token, else its EOS, else 0 (the labels
    of padding are -100 and packed rows mask it, so its value never matters)."""
    for name in ("pad_token_id", "eos_token_id"):
        found = getattr(tokenizer, name, None)
        if found is not None:
            return int(found)
    return 0


def build_rows(
    path: str, tokenizer, seq_len: int, loss_on: str, packing: bool, overlong: str
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The rows of the data at ``path`` and lines for the startup log: text files as one
    token stream (as always), instruction files as samples. Mixing the two kinds is a
    UserError (a text file has no answers to take the loss on)."""
    formats, records = read_records(path)
    kinds = sorted(set(formats.values()))
    if kinds == [TEXT]:
        rows, total = stream_rows([r.value for r in records], tokenizer, seq_len)
        return rows, [f"data: {total} tokens of text in {len(rows['input_ids'])} rows"]
    if TEXT in kinds:
        text = next(f for f, k in formats.items() if k == TEXT)
        other = next(f for f, k in formats.items() if k != TEXT)
        raise UserError(
            f"--data {path!r} mixes raw text ({text}) with instruction data ({other}, "
            f"{formats[other]!r}); train on one kind per run (a text sample can be written "
            "as {'prompt': '', 'completion': text})"
        )
    samples = [encode_record(r, tokenizer, loss_on) for r in records]
    kept, counts = fit(samples, seq_len, overlong)
    rows = (pack if packing else pad)(kept, seq_len, pad_id(tokenizer))
    loss_tokens = int((rows["labels"] != IGNORE_INDEX).sum())
    real = sum(len(ids) for ids, _ in kept)
    how = "packed" if packing else "padded"
    notes = [
        counts.describe(seq_len, overlong) + f", {', '.join(kinds)}",
        f"data: {len(rows['input_ids'])} rows of {seq_len} ({how}), "
        f"{real / max(1, rows['input_ids'].numel()):.0%} of the tokens real, {loss_tokens} "
        f"loss tokens (--loss-on {loss_on})",
    ]
    return rows, notes


def load_data(
    path: str,
    tokenizer,
    seq_len: int,
    micro_batch: int,
    *,
    dp_size: int = 1,
    dp_rank: int = 0,
    seed: int = 0,
    loss_on: str = "answers",
    packing: bool = True,
    overlong: str = "truncate",
    cache: str | None = None,
    shuffle: bool = True,
) -> RowData:
    """This dp rank's batches of the data at ``path`` (:func:`build_rows`); ``cache``: a
    directory where the rows are tokenized once and memory-mapped (None: no cache);
    ``shuffle=False``: in file order (evaluation data)."""
    options = {"seq_len": seq_len, "loss_on": loss_on, "packing": packing, "overlong": overlong}

    from .data_cache import rows_of

    def build():
        return build_rows(path, tokenizer, **options)

    rows, notes = rows_of(cache, path, tokenizer, options, build)
    data = RowData(
        rows,
        seq_len,
        micro_batch,
        dp_size=dp_size,
        dp_rank=dp_rank,
        seed=seed,
        what=f"{path}: ",
        shuffle=shuffle,
    )
    data.notes = list(notes)
    return data

"""The training data of a run, whatever its format (:mod:`.samples`): raw text streams as
language modelling (:class:`~.data.PackedData`); instruction data (``messages``,
``prompt``/``completion``) as samples with their loss masks (:mod:`.chat`), fitted to
``--seq-len`` and packed (or padded, ``--no-packing``) into rows (:mod:`.rows`)."""

from __future__ import annotations

from ..errors import UserError
from .chat import encode_record
from .data import PackedData, RowData
from .rows import fit, pack, pad
from .samples import TEXT, read_records


def pad_id(tokenizer) -> int:
    """The id padding uses: the tokenizer's pad token, else its EOS, else 0 (the labels
    of padding are -100 and packed rows mask it, so its value never matters)."""
    for name in ("pad_token_id", "eos_token_id"):
        found = getattr(tokenizer, name, None)
        if found is not None:
            return int(found)
    return 0


def load_data(
    path: str,
    tokenizer,
    seq_len: int,
    micro_batch: int,
    dp_size: int = 1,
    dp_rank: int = 0,
    seed: int = 0,
    loss_on: str = "answers",
    packing: bool = True,
    overlong: str = "truncate",
) -> RowData:
    """The run's data at ``path``: text files as one token stream (as always), instruction
    files as samples. Mixing the two kinds is a UserError (a text file has no answers to take
    the loss on: give it its own run, or make it ``{"prompt": "", "completion": text}``)."""
    formats, records = read_records(path)
    kinds = sorted(set(formats.values()))
    if kinds == [TEXT]:
        return PackedData(
            path,
            tokenizer,
            seq_len,
            micro_batch,
            dp_size,
            dp_rank,
            seed,
            documents=[r.value for r in records],
        )
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
    what = f"{path}: {counts.kept} samples ({'packed' if packing else 'padded'}) make "
    data = RowData(rows, seq_len, micro_batch, dp_size, dp_rank, seed, what)
    data.notes.append(counts.describe(seq_len, overlong) + f", {', '.join(kinds)}")
    tokens = int((rows["labels"] != -100).sum())
    cells = rows["input_ids"].numel()
    real = int((rows["segment_ids"] > 0).sum()) if packing else sum(len(s[0]) for s in kept)
    data.notes.append(
        f"data: {len(rows['input_ids'])} rows of {seq_len} ({'packed' if packing else 'padded'}"
        f"), {real / cells:.0%} of the tokens real, {tokens} loss tokens (--loss-on {loss_on})"
    )
    return data

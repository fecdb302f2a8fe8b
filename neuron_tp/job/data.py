"""Training data with static shapes: local .txt / .jsonl files (and .parquet / .arrow tables,
:mod:`.tables`), tokenized (a HF tokenizer directory or a byte-level fallback), packed into
fixed-length sequences, shuffled per epoch by the seed, split over data-parallel ranks,
incomplete batches dropped. The position in the
stream is one integer (:meth:`RowData.state_dict`), so a resumed run sees the same batches."""

from __future__ import annotations

import json
import os

import torch

from ..errors import UserError


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 plus an end-of-text token 256 (vocabulary 257)."""

    eos_token_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; the end-of-text token is always skipped."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def load_tokenizer(path: str | None):
    """The HF tokenizer in the local directory ``path``, or :class:`ByteTokenizer` for None or
    ``"bytes"``. Which tokenizer a run uses is :func:`neuron_tp.job.tokenizer.
    resolve_tokenizer`'s decision."""
    if path is None or path == "bytes":
        return ByteTokenizer()
    if not os.path.isdir(path):
        raise UserError(
            f"--tokenizer {path!r} is not a directory; pass a local HF tokenizer "
            "directory or --tokenizer bytes for the byte-level tokenizer"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def vocab_size(tokenizer) -> int:
    return len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size


TEXT_SUFFIXES = (".txt", ".jsonl")
DATA_SUFFIXES = (*TEXT_SUFFIXES, ".parquet", ".arrow")  # tables: through `datasets`


def data_files(path: str, suffixes: tuple[str, ...] = DATA_SUFFIXES) -> list[str]:
    """The data files (``suffixes``) at ``path`` (a file, or a directory searched
    recursively)."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    else:
        raise UserError(f"--data {path!r} does not exist")
    files = [f for f in files if f.endswith(suffixes)]
    if not files:
        kinds = ", ".join(suffixes[:-1]) + f" or {suffixes[-1]}"
        raise UserError(f"--data {path!r}: no {kinds} files")
    return files


def read_text(f: str) -> str:
    """The UTF-8 text of file ``f`` with universal newlines (as ``open(f)`` reads it);
    ValueError naming the file, byte offset and line of the first invalid byte."""
    with open(f, "rb") as fh:
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UserError(
            f"{f}: not UTF-8 text: byte {e.start} (line {line}) is "
            f"{raw[e.start : e.start + 1]!r} ({e.reason}); convert the file to UTF-8 "
            f"(e.g. iconv -f latin1 -t utf-8) or leave it out"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_documents(path: str) -> list[str]:
    """Documents: a .txt file is one document, each .jsonl line's ``text`` field is one."""
    docs = []
    for f in data_files(path, TEXT_SUFFIXES):
        text = read_text(f)
        if f.endswith(".txt"):
            docs.append(text)
            continue
        for n, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                docs.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"{f}:{n}: expected a JSON object with a 'text' field") from None
    return docs


class RowData:
    """Fixed ``[micro_batch, seq_len]`` batches of one dp rank, drawn from equal-shape
    ``[n, seq_len]`` int64 row tensors (``rows``; ``input_ids`` and ``labels`` always, see
    :mod:`neuron_tp.job.rows` for the packed ones).

    Global batch ``b`` is the rows ``perm[b*G : (b+1)*G]`` of the epoch's permutation
    (``G = micro_batch * dp``); dp rank ``r`` takes its ``r``-th slice of ``micro_batch``
    rows. So dp=2 x micro_batch=m sees the same rows as dp=1 x micro_batch=2m.
    ``notes``: lines for the startup log (what was dropped or truncated).
    ``shuffle=False``: the row order every epoch (evaluation data).
    """

    def __init__(
        self,
        rows: dict[str, torch.Tensor],
        seq_len: int,
        micro_batch: int,
        *,
        dp_size: int = 1,
        dp_rank: int = 0,
        seed: int = 0,
        what: str = "",
        shuffle: bool = True,
    ):
        self.rows, self.shuffle = rows, shuffle
        self.notes: list[str] = []
        self.seq_len, self.micro_batch, self.seed = seq_len, micro_batch, seed
        self.dp_size, self.dp_rank = dp_size, dp_rank
        n = len(rows["input_ids"])
        self.global_batch = micro_batch * dp_size
        self.batches_per_epoch = n // self.global_batch
        if self.batches_per_epoch == 0:
            raise UserError(
                f"{what}{n} sequences of {seq_len}, fewer than one global batch "
                f"({self.global_batch} = micro_batch x dp); use more data or a smaller "
                "--seq-len / --micro-batch"
            )
        self.position = 0  # global batches consumed so far
        self._perm_epoch, self._perm = -1, torch.arange(0)

    @property
    def chunks(self) -> torch.Tensor:
        """The ``[n, seq_len]`` token ids of every row (what the ranks agree on)."""
        return self.rows["input_ids"]

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
            n = len(self.chunks)
            perm = torch.randperm(n, generator=g) if self.shuffle else torch.arange(n)
            self._perm, self._perm_epoch = perm, epoch
        return self._perm

    def _rows_of(self, position: int, whole: bool) -> torch.Tensor:
        """The row indices of global batch ``position``: all of them (``whole``) or this dp
        rank's."""
        epoch, b = divmod(position, self.batches_per_epoch)
        start = b * self.global_batch + (0 if whole else self.dp_rank * self.micro_batch)
        return self._permutation(epoch)[
            start : start + (self.global_batch if whole else self.micro_batch)
        ]

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's next batch: ``[micro_batch, seq_len]`` CPU int64 tensors by name."""
        idx = self._rows_of(self.position, whole=False)
        self.position += 1
        return {name: t[idx] for name, t in self.rows.items()}

    def loss_tokens(self, batches: int = 1) -> int:
        """The tokens the loss is taken on in the next ``batches`` global batches, every dp
        rank's (labels other than -100 after HF's shift: the first column never counts), read
        from the rows every rank holds, without moving on."""
        labels = self.rows["labels"]
        return sum(
            int((labels[self._rows_of(self.position + i, whole=True), 1:] != -100).sum())
            for i in range(batches)
        )

    def state_dict(self) -> dict:
        return {
            "position": self.position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "global_batch"):
            if state.get(key) != getattr(self, key):
                raise UserError(
                    f"checkpoint data position was recorded with {key}="
                    f"{state.get(key)}, this run has {getattr(self, key)}; "
                    "resume with the same --seed/--seq-len/--micro-batch x dp"
                )
        self.position = int(state["position"])


class PackedData(RowData):
    """Language modelling on raw text: every document's tokens (and EOS) in one stream cut
    into ``seq_len`` rows, the loss on every token (``labels`` is ``input_ids``)."""

    def __init__(
        self,
        path: str,
        tokenizer,
        seq_len: int,
        micro_batch: int,
        *,
        dp_size: int = 1,
        dp_rank: int = 0,
        seed: int = 0,
        documents: list[str] | None = None,
    ):
        """``documents``: the texts already read from ``path`` (None: read them)."""
        docs = read_documents(path) if documents is None else documents
        rows, total = stream_rows(docs, tokenizer, seq_len)
        what = f"{path}: {total} tokens make "
        super().__init__(
            rows, seq_len, micro_batch, dp_size=dp_size, dp_rank=dp_rank, seed=seed, what=what
        )


def stream_rows(
    documents: list[str], tokenizer, seq_len: int
) -> tuple[dict[str, torch.Tensor], int]:
    """Every document's ids (and EOS) in one stream cut into ``[n, seq_len]`` rows, the labels
    the ids themselves; with the stream's length (the tail shorter than a row is left out)."""
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for doc in documents:
        ids.extend(tokenizer.encode(doc))
        if eos is not None:
            ids.append(eos)
    n = len(ids) // seq_len
    chunks = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    return {"input_ids": chunks, "labels": chunks}, len(ids)

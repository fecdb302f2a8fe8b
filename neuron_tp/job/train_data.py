"""The rows ``neuron-tp train`` reads: one loader for the job's setup, its evaluation and
``train --check``, choosing preference pairs or text / instruction rows by the options."""

from __future__ import annotations

from .data import RowData
from .pairs import load_pairs
from .sft_data import load_data


def load_train_rows(
    config,
    path: str,
    tokenizer,
    *,
    dp_size: int,
    dp_rank: int = 0,
    training: bool = True,
    in_order: bool = False,
) -> RowData:
    """The rows ``neuron-tp train`` (a ``TrainConfig``) reads from ``path`` for one dp rank:
    preference pairs (padded, never packed: :func:`~.pairs.load_pairs`) for the training and
    eval data of ``--objective dpo|orpo``, else text or instruction rows by the data options.
    ``training=False``: evaluation data; ``in_order``: file order and no data cache (eval,
    ``train --check``)."""
    if config.preference.objective != "lm":
        return load_pairs(
            path,
            tokenizer,
            config.seq_len,
            config.micro_batch,
            dp_size=dp_size,
            dp_rank=dp_rank,
            seed=config.seed,
            shuffle=not in_order,
            cache=None if in_order else config.data_cache,
        )
    return load_data(
        path,
        tokenizer,
        config.seq_len,
        config.micro_batch,
        dp_size=dp_size,
        dp_rank=dp_rank,
        seed=config.seed,
        loss_on=config.loss_on,
        packing=config.packing,
        overlong=config.overlong,
        cache=None if in_order else config.data_cache,
        shuffle=not in_order,
    )

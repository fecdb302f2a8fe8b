"""Checks of a ``--tp-mode 2d|3d`` training run made locally, before any collective: the
micro-batch the grid splits, the model family the 2D/3D layers take (the tp degree itself is
checked by :class:`~neuron_tp.parallel.mesh.Mesh`, head and size splits by ``parallelize``)."""

from __future__ import annotations

import os

from ..job.config import TrainConfig
from ..job.presets import is_preset
from ..parallel.mesh import grid_side

ND_MODEL_TYPES = ("llama", "mistral", "qwen2")


def check_tp_mode(config: TrainConfig, tokenizer_vocab: int) -> None:
    """ValueError (local, before any collective) for a --tp-mode 2d/3d run that cannot work:
    a micro-batch the grid does not split, a model the 2D/3D layers do not take (tp itself
    was checked by the Mesh; head and size splits by ``parallelize``)."""
    if config.tp_mode == "1d":
        return
    from ..job.presets import model_config

    q = grid_side(config.tp, config.tp_mode)
    chunks = q if config.tp_mode == "2d" else q * q
    if config.micro_batch % chunks:
        valid = ", ".join(str(chunks * k) for k in range(1, 5))
        raise ValueError(
            f"--tp-mode {config.tp_mode} with --tp {config.tp} (q={q}) splits every micro-batch "
            f"into {chunks} batch chunks: --micro-batch must be a multiple of {chunks} "
            f"({valid}, ...), got {config.micro_batch}"
        )
    if not is_preset(config.model) and not os.path.isfile(
        os.path.join(config.model, "config.json")
    ):
        return  # startup_values says what is wrong with the directory
    cfg = model_config(config.model, tokenizer_vocab)
    if cfg.model_type not in ND_MODEL_TYPES or getattr(cfg, "tie_word_embeddings", False):
        what = "tied embeddings" if cfg.model_type in ND_MODEL_TYPES else cfg.model_type
        raise ValueError(
            f"--tp-mode {config.tp_mode} supports untied Llama-family models "
            f"({', '.join(ND_MODEL_TYPES)}); --model {config.model} is {what}: use "
            f"--tp-mode 1d"
        )

"""The one start-up of a slot generator for ``neuron-tp generate`` and ``neuron-tp serve``:
the model loaded onto this rank's device, the KV cache split chosen, the generator made (plain
or speculative) with its shape from the options, and the model's EOS ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from ..job.config import GenerateConfig
from ..parallel.mesh import Mesh


@dataclass(frozen=True)
class SlotShape:
    """The fixed shapes of a slot generator: concurrent sequences, positions per slot, prompt
    tokens per prefill step and the prefill and decode buckets."""

    slots: int
    max_len: int
    chunk: int
    prefill_buckets: tuple[int, ...]
    decode_buckets: tuple[int, ...]

    @classmethod
    def of(cls, config: GenerateConfig, chunk: int | None = None) -> SlotShape:
        """The shape the options ask for (``chunk``: prompt tokens per step, default and at
        most the largest prompt bucket)."""
        largest = max(config.buckets)
        chunk = min(chunk or largest, largest)
        return cls(
            slots=max(config.batch_buckets),
            max_len=largest + config.max_new_tokens,
            chunk=chunk,
            prefill_buckets=tuple(sorted({b for b in config.buckets if b < chunk} | {chunk})),
            decode_buckets=tuple(config.batch_buckets),
        )


@dataclass
class Loaded:
    """A loaded model's slot generator, its tokenizer and EOS ids (``speculative``: made by
    a speculation method)."""

    gen: Any
    tokenizer: Any
    eos_ids: list[int]
    speculative: bool


def check_positions(model_config, shape: SlotShape, max_new_tokens: int) -> None:
    """UserError, naming what fits, when a slot's positions exceed the model's."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is None or shape.max_len <= limit:
        return
    largest = shape.max_len - max_new_tokens
    fixes = []
    if limit > largest:
        fixes.append(f"--max-new-tokens {limit - largest}")
    if limit > max_new_tokens:
        fixes.append(f"--buckets with the largest at most {limit - max_new_tokens}")
    raise UserError(
        f"a slot of {shape.max_len} positions (largest bucket {largest} + --max-new-tokens "
        f"{max_new_tokens}) exceeds the model's max_position_embeddings={limit}: pass "
        + (" or ".join(fixes) or "a model with more positions")
    )


def load_slot_generator(
    config: GenerateConfig, mesh: Mesh, shape: SlotShape, *, serving: bool = False
) -> Loaded:
    """Load ``config.model`` for ``mesh`` onto this rank's device and make its slot
    generator of ``shape`` (``serving``: also the graphs the server's request fields need:
    prompt log-probabilities and top_p)."""
    from ..job.runtime import rank_device
    from ..parallel.sharding import move_to
    from .kv_split import resolve
    from .load import eos_ids, load_for_generation
    from .slot_generator import SlotGenerator
    from .speculation_setup import speculating_generator

    model, tok = load_for_generation(config, mesh)
    check_positions(model.config, shape, config.max_new_tokens)
    move_to(model, rank_device(config.device))  # keeps tied embeddings tied
    split = resolve(config.kv_split, model.config, mesh.tp_size)
    make, extra = speculating_generator(config, mesh)
    serving_graphs = {"prompt_logprobs": True, "top_p": True} if serving and not make else {}
    gen = (make or SlotGenerator)(
        model,
        **extra,
        slots=shape.slots,
        max_len=shape.max_len,
        chunk=shape.chunk,
        prefill_buckets=list(shape.prefill_buckets),
        decode_buckets=list(shape.decode_buckets),
        pad_id=getattr(tok, "pad_token_id", None) or 0,
        kv_split=split,
        **serving_graphs,
    )
    stops = [] if getattr(config, "ignore_eos", False) else eos_ids(model, tok)
    return Loaded(gen, tok, stops, make is not None)

"""The speculation ``neuron-tp generate`` and ``serve`` options ask for (``--draft-model``,
``--speculation-method``, ``--speculation-length``, ``--prompt-lookup-max/min``): checked
before any work, then the generator class and its extra arguments, the draft loaded."""

from __future__ import annotations

from ..errors import UserError


def speculation_method(config) -> str | None:
    """The speculation a ``generate`` / ``serve`` config asks for: ``"draft"`` (its
    ``--draft-model``), ``"ngram"`` or None; UserError for options that contradict each other
    or an empty n-gram range."""
    method = config.speculation_method or ("draft" if config.draft_model else None)
    if method == "draft" and not config.draft_model:
        raise UserError(
            "--speculation-method draft needs --draft-model DIR (a smaller causal LM with "
            "the same tokenizer); without a second model use --speculation-method ngram"
        )
    if method == "ngram":
        from .ngram import check_lookup

        if config.draft_model:
            raise UserError(
                f"--speculation-method ngram proposes from the request's own text: drop "
                f"--draft-model {config.draft_model}, or use --speculation-method draft"
            )
        check_lookup(config.prompt_lookup_max, config.prompt_lookup_min)
    return method


def check_speculation_options(config, max_len: int) -> None:
    """UserError, before any weight is read, unless the speculation ``config`` (a
    GenerateConfig) asks for can run in slots of ``max_len`` positions (a draft: the same
    vocabulary and tokenizer as ``--model``)."""
    method = speculation_method(config)
    if method == "draft":
        from .load import check_draft

        check_draft(config, max_len)
    elif method == "ngram":
        from .speculative import check_speculation

        check_speculation(config.speculation_length, max_len)


def speculating_generator(config, mesh) -> tuple[type | None, dict]:
    """The generator class ``config`` (a GenerateConfig) asks for and its arguments beyond a
    SlotGenerator's (the draft loaded onto this rank's device and sharded like the model);
    ``(None, {})``: no speculation."""
    method = speculation_method(config)
    k = {"k": config.speculation_length}
    if method == "ngram":
        from .ngram import NgramGenerator

        lookup = {"lookup_max": config.prompt_lookup_max, "lookup_min": config.prompt_lookup_min}
        return NgramGenerator, {**k, **lookup}
    if method != "draft":
        return None, {}
    from ..job.runtime import rank_device
    from ..parallel.sharding import move_to
    from .load import draft_config, load_for_generation
    from .speculative import SpeculativeGenerator

    draft, _ = load_for_generation(draft_config(config), mesh)
    move_to(draft, rank_device(config.device))
    return SpeculativeGenerator, {"draft": draft, **k}

"""``neuron-tp generate``: sharded generation from the command line, with latency figures."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from ..errors import UserError
from ..job.config import GenerateConfig
from ..parallel.sharding import move_to
from .load import eos_ids, load_for_generation
from .sampling import Sampling
from .speculation_setup import check_speculation_options, speculating_generator, speculation_method
from .static_generator import Generator
from .text import Detokenizer


def run_cli(args: GenerateConfig | argparse.Namespace) -> list[str]:
    """Print each prompt's continuation and the latency (rank 0); return the texts. The ranks
    first agree on every option, the prompts and library versions (one small all-gather)."""
    from ..job.runtime import rank_device, start
    from ..parallel import agreement
    from ..parallel.mesh import init_mesh

    config = GenerateConfig.from_args(args)
    world, prompts = start(config.device), list(config.prompt)
    with agreement.agreed(world, "neuron-tp generate") as agree:  # local work, then the check
        if config.prompts_file:
            from ..job.data import read_text

            prompts += [ln for ln in read_text(config.prompts_file).split("\n") if ln.strip()]
        if not prompts:
            raise UserError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
        check_speculation_options(config, max(config.buckets) + config.max_new_tokens)
        from .kv_split import check_mode

        check_mode(config.kv_split)
        agree.values = config.option_values()
        agree.values.update({"prompts": prompts, "library versions": agreement.versions()})
    device = rank_device(config.device)
    mesh = init_mesh(tp=config.tp)
    model, tok = load_for_generation(config, mesh)
    move_to(model, device)  # keeps tied embeddings tied
    pad = getattr(tok, "pad_token_id", None) or 0
    sampling = Sampling(config.do_sample, config.temperature, config.top_k, config.seed)
    stops = [] if config.ignore_eos else eos_ids(model, tok)
    if speculation_method(config):
        return _speculate(config, model, tok, mesh, prompts, sampling=sampling, eos=stops)
    if config.kv_split == "sequence":  # auto: generate's static batches keep whole heads
        return _split_by_sequence(config, model, tok, mesh, prompts, sampling=sampling, eos=stops)
    gen = Generator(
        model, config.buckets, config.max_new_tokens, batch_buckets=config.batch_buckets, pad_id=pad
    )
    texts: list[str] = []
    for first in range(0, len(prompts), gen.batch_buckets[-1]):
        chunk = prompts[first : first + gen.batch_buckets[-1]]
        texts += _run_batch(
            gen, tok, chunk, config=config, sampling=sampling, eos=stops, show=mesh.rank == 0
        )
    return texts


def _run_batch(gen, tok, prompts, *, config, sampling, eos, show: bool) -> list[str]:
    """Generate one batch; print its continuations, TTFT and decode tokens/s on rank 0."""
    from ..backend.graphs import graph_counters

    detok = [Detokenizer(tok, config.stop) for _ in prompts]
    stopped = [False] * len(prompts)
    t0 = time.perf_counter()
    ttft, steps, tokens = None, 0, 0
    for column in gen.stream(
        [tok.encode(p) for p in prompts], config.max_new_tokens, sampling, eos, stopped
    ):
        ttft = ttft if ttft is not None else time.perf_counter() - t0
        steps += 1
        for i, t in enumerate(column):
            if t is not None:
                tokens += 1
                detok[i].add(t)
                stopped[i] = detok[i].stopped
    elapsed = time.perf_counter() - t0
    texts = [d.text + d.finish() for d in detok]
    if show:
        for p, t in zip(prompts, texts):
            print(f"{p!r} -> {t!r}")
        decode = elapsed - ttft
        rate = (tokens - len(prompts)) / decode if steps > 1 and decode > 0 else float("nan")
        print(
            f"batch {len(prompts)}: TTFT {ttft * 1e3:.1f} ms, {tokens} tokens in "
            f"{elapsed * 1e3:.0f} ms, decode {rate:.1f} tokens/s "
            f"({decode / max(steps - 1, 1) * 1e3:.2f} ms/step); "
            f"graph compiles so far: {graph_counters()['compiles']}"
        )
    return texts


def _split_by_sequence(config, model, tok, mesh, prompts, *, sampling, eos) -> list[str]:
    """``--kv-split sequence``: the prompts on the slots of a :class:`~.slot_generator.
    SlotGenerator` whose KV cache is split by sequence (``max(--batch-buckets)`` at once)."""
    from .slot_generator import SlotGenerator

    gen = SlotGenerator(model, **_slot_args(config, tok), kv_split="sequence")
    texts, elapsed = _on_slots(gen, tok, prompts, config=config, sampling=sampling, eos=eos)
    _print_texts(
        mesh,
        prompts,
        texts,
        f"KV cache split by sequence over {gen.split.r} ranks: "
        f"{gen.kv_bytes / 2**20:.2f} MiB per rank; {elapsed * 1e3:.0f} ms",
    )
    return texts


def _print_texts(mesh, prompts: list[str], texts: list[str], summary: str) -> None:
    """Rank 0 prints each prompt's continuation, then ``summary``."""
    if mesh.rank == 0:
        for p, t in zip(prompts, texts):
            print(f"{p!r} -> {t!r}")
        print(summary)


def _slot_args(config, tok) -> dict:
    """The slot generator's shape arguments for the generate options."""
    max_len, chunk = max(config.buckets) + config.max_new_tokens, max(config.buckets)
    return dict(
        slots=config.batch_buckets[-1],
        max_len=max_len,
        chunk=chunk,
        prefill_buckets=config.buckets,
        decode_buckets=config.batch_buckets,
        pad_id=getattr(tok, "pad_token_id", None) or 0,
    )


def _speculate(config, model, tok, mesh, prompts, *, sampling, eos) -> list[str]:
    """``--draft-model`` / ``--speculation-method``: the prompts on the slots of a
    :class:`~.speculative.VerifyingGenerator` (``max(--batch-buckets)`` at once; a sampled
    prompt ``i`` seeded ``--seed + i``); prints as :func:`_run_batch` plus the acceptance."""
    make, extra = speculating_generator(config, mesh)
    split = "sequence" if config.kv_split == "sequence" else "heads"  # as the static batches'
    gen = make(model, **_slot_args(config, tok), **extra, kv_split=split)
    texts, elapsed = _on_slots(gen, tok, prompts, config=config, sampling=sampling, eos=eos)
    st = gen.stats
    _print_texts(
        mesh,
        prompts,
        texts,
        f"speculative decoding (k={st.k}): {st.accepted}/{st.proposed} proposed tokens "
        f"accepted ({st.acceptance:.0%}), {st.tokens_per_step:.2f} tokens per slot and "
        f"model step, {st.tokens} tokens in {elapsed * 1e3:.0f} ms",
    )
    return texts


def _on_slots(gen, tok, prompts, *, config, sampling, eos) -> tuple[list[str], float]:
    """Every prompt through ``gen``'s slots (a sampled prompt ``i`` seeded ``--seed + i``),
    ``gen.slots`` at a time: the texts (on every rank) and the seconds it took."""
    from .schedule import Admission, Delta, Failed, Lease, Request
    from .slot_rows import SlotRows

    texts, t0, failed = [""] * len(prompts), time.perf_counter(), []

    def sink(i: int):
        def take(event) -> None:
            if isinstance(event, Failed):
                failed.append(f"prompt {i}: {event.message}")
            if isinstance(event, Delta):
                texts[i] += event.text

        return take

    reqs = []
    for i, p in enumerate(prompts):
        s = sampling if not sampling.do_sample else replace(sampling, seed=sampling.seed + i)
        ids = tok.encode(p)
        try:
            gen.check(len(ids), config.max_new_tokens, s)
        except ValueError as e:
            raise UserError(f"prompt {i}: {e}") from None
        reqs.append(Request(ids, config.max_new_tokens, s, list(config.stop), True, sink(i)))
    rows = SlotRows(
        gen,
        tok,
        eos,
        None,
        dict.fromkeys(("steps", "max_batch", "cancelled", "dropped", "failed"), 0),
    )
    for first in range(0, len(reqs), gen.slots):
        batch = reqs[first : first + gen.slots]
        lease = Lease((), tuple(Admission.of(r) for r in batch), steps=2**31)
        rows.run(lease, batch)  # every rank collects the texts
    if failed:
        raise RuntimeError("; ".join(failed))
    return texts, time.perf_counter() - t0

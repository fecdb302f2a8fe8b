"""``neuron-tp generate``: sharded generation from the command line, with latency figures: a
client of the serving :class:`~.engine.Engine` (the same slot generator, KV cache split,
speculation and start-up as ``neuron-tp serve``), every rank running the same prompts."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from ..errors import UserError
from ..job.config import GenerateConfig
from .engine import Engine
from .sampling import Sampling
from .schedule import Delta, Failed, Request
from .slots_setup import SlotShape, load_slot_generator
from .speculation_setup import check_speculation_options


def run_cli(args: GenerateConfig | argparse.Namespace) -> list[str]:
    """Print each prompt's continuation and the latency (rank 0); return the texts. The ranks
    first agree on every option, the prompts and library versions (one small all-gather)."""
    from ..job.runtime import start
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
    mesh = init_mesh(tp=config.tp)
    loaded = load_slot_generator(config, mesh, SlotShape.of(config))
    engine = Engine(mesh.group("world"))
    engine.attach(loaded.gen, loaded.tokenizer, loaded.eos_ids, config.max_new_tokens)
    sampling = Sampling(config.do_sample, config.temperature, config.top_k, config.seed)
    t0 = time.perf_counter()
    texts = _generate(engine, prompts, config, sampling)
    elapsed = time.perf_counter() - t0
    if mesh.rank == 0:
        for p, t in zip(prompts, texts):
            print(f"{p!r} -> {t!r}")
        print(_summary(engine, loaded, len(prompts), elapsed))
    return texts


def _generate(engine: Engine, prompts: list[str], config, sampling: Sampling) -> list[str]:
    """Every prompt through the engine's slots (a sampled prompt ``i`` seeded ``--seed +
    i``): the texts, on every rank."""
    tok, gen = engine.tokenizer, engine.gen
    assert gen is not None  # attached
    texts, failed = [""] * len(prompts), []

    def sink(i: int):
        def take(event) -> None:
            if isinstance(event, Failed):
                failed.append(f"prompt {i}: {event.message}")
            if isinstance(event, Delta):
                texts[i] += event.text

        return take

    requests = []
    for i, p in enumerate(prompts):
        s = sampling if not sampling.do_sample else replace(sampling, seed=sampling.seed + i)
        ids = tok.encode(p)
        try:
            gen.check(len(ids), config.max_new_tokens, s)
        except ValueError as e:
            raise UserError(f"prompt {i}: {e}") from None
        requests.append(Request(ids, config.max_new_tokens, s, list(config.stop), True, sink(i)))
    engine.run_all(requests)
    if failed:
        raise RuntimeError("; ".join(failed))
    return texts


def _summary(engine: Engine, loaded, prompts: int, elapsed: float) -> str:
    """One line: tokens and time, the KV cache split, graph compiles, speculation."""
    from ..backend.graphs import graph_counters

    gen = loaded.gen
    line = (
        f"{prompts} prompt(s): {elapsed * 1e3:.0f} ms in {engine.stats['steps']} engine steps; "
        f"KV cache split by {gen.kv_split}, {gen.kv_bytes / 2**20:.2f} MiB per rank; "
        f"graph compiles so far: {graph_counters()['compiles']}"
    )
    if loaded.speculative:
        st = gen.stats
        line += (
            f"; speculative decoding (k={st.k}): {st.accepted}/{st.proposed} proposed tokens "
            f"accepted ({st.acceptance:.0%}), {st.tokens_per_step:.2f} tokens per slot and "
            f"model step, {st.tokens} tokens"
        )
    return line

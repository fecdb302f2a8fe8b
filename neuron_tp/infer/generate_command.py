"""``neuron-tp generate``: sharded generation from the command line, with latency figures."""

from __future__ import annotations

import argparse
import time

from ..errors import UserError
from ..job.config import GenerateConfig
from ..parallel.sharding import move_to
from .load import eos_ids, load_for_generation
from .sampling import Sampling
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
        agree.values = config.option_values()
        agree.values.update({"prompts": prompts, "library versions": agreement.versions()})
    device = rank_device(config.device)
    mesh = init_mesh(tp=config.tp)
    model, tok = load_for_generation(config, mesh)
    move_to(model, device)  # keeps tied embeddings tied
    pad = getattr(tok, "pad_token_id", None) or 0
    gen = Generator(
        model, config.buckets, config.max_new_tokens, batch_buckets=config.batch_buckets, pad_id=pad
    )
    sampling = Sampling(config.do_sample, config.temperature, config.top_k, config.seed)
    stops = [] if config.ignore_eos else eos_ids(model, tok)
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

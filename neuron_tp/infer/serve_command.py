"""``neuron-tp serve`` on this rank: the start-up (agreement, mesh, the slot generator's one
start-up in :mod:`.slots_setup`, the prefix cache, the model's sampling defaults, warm-up), then
rank 0 answers HTTP (:mod:`.server`) while the other tp ranks follow its batches."""

import logging
import os
import threading
import time

from ..errors import UserError
from .engine import Engine
from .limits import API_KEY_ENV, ServeLimits
from .metrics import LOG
from .prefix_cache import PrefixCache, held_per_block, pool_blocks, resolve_block
from .request_params import generation_defaults
from .server import create_app
from .speculation_setup import check_speculation_options
from .speculative import SpeculativeGenerator


def serve(config, stop: threading.Event | None = None) -> None:
    """``neuron-tp serve`` on this rank: load the model, warm up, then rank 0 answers HTTP
    (``/health`` from the start, ``/ready`` once warm) while the other tp ranks follow its
    batches. SIGTERM/SIGINT (on the main thread; or ``stop`` set by the caller): rank 0 stops
    accepting, finishes what runs, tells the other ranks to stop; every rank returns."""
    from ..job.config import ServeConfig
    from ..job.runtime import start
    from ..parallel import agreement
    from ..parallel.mesh import init_mesh

    config = ServeConfig.from_args(config)
    world = start(config.device)
    with agreement.agreed(world, "neuron-tp serve") as agree:  # local checks, then the check
        if world.size != config.tp:
            raise UserError(
                f"neuron-tp serve runs one server over its tp ranks: launch exactly --tp "
                f"{config.tp} processes, got {world.size}"
            )
        check_speculation_options(config.generate_config(), _max_len(config))
        check_lora_options(config)
        if world.rank == 0:
            import fastapi  # noqa: F401 - fail before loading a model
            import uvicorn  # noqa: F401
        if config.prefix_cache_on:
            resolve_block(config.prefix_block, _chunk(config))
        from .kv_split import check_mode

        check_mode(config.kv_split)
        agree.values = {**config.option_values(), "library versions": agreement.versions()}
        agree.values.pop("--api-key", None)  # rank 0's alone; never shown in a mismatch report
    mesh = init_mesh(tp=config.tp)
    engine = Engine(mesh.group("world"), max_queue=config.max_queue)
    stop = stop or stop_on_signals()
    if mesh.rank != 0:
        load_engine(engine, config, mesh)
        engine.follow(should_stop=stop.is_set)
        return
    import uvicorn

    limits = ServeLimits(
        api_key=config.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=config.max_body_bytes,
        request_timeout_s=config.request_timeout_s,
    )
    log_requests()
    app = create_app(engine, config.model_name, limits)
    server = uvicorn.Server(
        uvicorn.Config(
            app, config.host, config.port, log_level="warning", timeout_graceful_shutdown=10
        )
    )
    # HTTP on a thread from the start (/health answers while the model loads); the model
    # loads on the main thread, like the other ranks (host exchanges count calls per thread).
    http = threading.Thread(target=server.run, name="http", daemon=True)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError(f"neuron-tp serve: cannot listen on {config.host}:{config.port}")
    try:
        load_engine(engine, config, mesh)
        engine.start()
        print(f"neuron-tp serve: ready on http://{config.host}:{config.port}", flush=True)
        while not stop.wait(0.1) and http.is_alive() and engine.error is None:
            pass
    finally:
        server.should_exit = True
        http.join()
        engine.shutdown()
    if engine.error is not None:
        raise RuntimeError(f"neuron-tp serve: {engine.error}")


def log_requests() -> None:
    """Print the log line of each finished request (``neuron_tp.serve``) on stderr."""
    if not LOG.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s neuron-tp serve: %(message)s"))
        LOG.addHandler(handler)
        LOG.setLevel(logging.INFO)
        LOG.propagate = False


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (handlers installed when called on the main
    thread)."""
    import signal

    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda _s, _f: stop.set())
    return stop


def load_engine(engine: Engine, config, mesh) -> None:
    """Load the model onto this rank's device, attach it to ``engine`` and warm up."""
    from .slots_setup import SlotShape, load_slot_generator

    generate = config.generate_config()
    loaded = load_slot_generator(
        generate, mesh, SlotShape.of(generate, config.prefill_chunk), serving=True
    )
    gen, tok, model = loaded.gen, loaded.tokenizer, loaded.gen.model
    if mesh.rank == 0:
        print(
            f"neuron-tp serve: KV cache split by {gen.kv_split}, "
            f"{gen.kv_bytes / 2**20:.1f} MiB per rank",
            flush=True,
        )
    prefix = _prefix_cache(config, gen, rank0=mesh.rank == 0)
    slots, adapters = _lora_bank(config, gen, rank0=mesh.rank == 0)
    engine.attach(gen, tok, loaded.eos_ids, config.max_new_tokens, prefix, lora=slots)
    engine.adapters = adapters
    defaults = generation_defaults(getattr(model, "generation_config", None))
    left_out = {}
    if loaded.speculative:  # speculation applies temperature and top_k only
        left_out = {k: v for k, v in defaults.items() if k not in ("temperature", "top_k")}
        defaults = {k: v for k, v in defaults.items() if k not in left_out}
    engine.sampling_defaults = defaults
    engine.tool_call_parser = config.tool_call_parser
    if mesh.rank == 0:
        said = ", ".join(f"{k}={v}" for k, v in defaults.items()) or "none"
        print(
            f"neuron-tp serve: sampling defaults from the model's generation_config: {said} "
            "(a request's own values win)",
            flush=True,
        )
        if left_out:
            said = ", ".join(f"{k}={v}" for k, v in left_out.items())
            print(
                f"neuron-tp serve: generation_config's {said} not applied: speculative "
                "decoding applies temperature and top_k only",
                flush=True,
            )
    engine.warmup(every_shape=config.warmup == "all")


def check_lora_options(config) -> None:
    """UserError (before any collective) for LoRA options that cannot be served: ``--adapter``
    beside them, a ``--lora-modules`` entry that is not ``NAME=DIR`` of a LoRA
    adapter directory."""
    from ..hf.lora_files import read_adapter_config
    from .lora_slots import parse_lora_module

    lora = config.lora
    if not lora.on:
        return
    if config.adapter:
        raise UserError(
            "--adapter merges one adapter into the base; with --lora-modules serve it as "
            f"NAME={config.adapter} instead"
        )
    names = []
    for spec in lora.lora_modules:
        name, path = parse_lora_module(spec)
        read_adapter_config(path, what=f"--lora-modules {name}={path}")
        names.append(name)
    if len(set(names)) < len(names) or config.model_name in names:
        raise UserError(
            f"--lora-modules names {names}: each must be unique and not the served model "
            f"name {config.model_name!r}"
        )


def _lora_bank(config, gen, rank0: bool):
    """The LoRA bank of ``gen``'s model (``--max-loras`` slots of rank ``--max-lora-rank``)
    with the ``--lora-modules`` adapters known (None, None without LoRA serving)."""
    from ..hf.lora_bank import LoraBank
    from .lora_slots import Adapters, BankSlots, HostAdapters, parse_lora_module

    lora = config.lora
    if not lora.on:
        return None, None
    bank = LoraBank(gen.model, lora.max_loras, lora.max_lora_rank)
    gen.lora = bank  # before warm-up: every graph takes the bank's tensors
    host = HostAdapters(lora.max_cpu_loras or lora.max_loras)
    adapters = Adapters(config.model_name, bank, host)
    for spec in lora.lora_modules:  # every rank checks them: the same refusal everywhere
        adapters.load(*parse_lora_module(spec))
    if rank0:
        mib = sum(t.numel() * t.element_size() for t in bank.tensors) / 2**20
        names = ", ".join(r.name for r in adapters.all()) or "none yet"
        print(
            f"neuron-tp serve: LoRA bank of {bank.slots} slots x rank {bank.max_rank} on "
            f"{len(bank.targets)} projections, {mib:.1f} MiB per rank; adapters: {names}",
            flush=True,
        )
    return BankSlots(bank, host), adapters


def _max_len(config) -> int:
    """Positions per slot: the longest prompt bucket and ``--max-new-tokens``."""
    return max(config.buckets) + config.max_new_tokens


def _chunk(config) -> int:
    """Prompt tokens prefilled per step: ``--prefill-chunk`` capped to the largest bucket."""
    return min(config.prefill_chunk, max(config.buckets))


def _prefix_cache(config, gen, rank0: bool) -> PrefixCache | None:
    """This rank's prefix cache (None: ``--no-prefix-caching``); rank 0 prints its size."""
    if not config.prefix_cache_on:
        return None
    block = resolve_block(config.prefix_block, gen.chunk)
    draft = gen.draft.model if isinstance(gen, SpeculativeGenerator) else None
    blocks = pool_blocks(
        gen.model,
        draft=draft,
        block=held_per_block(gen, block),  # split by sequence: a rank holds 1/r of a block
        blocks=config.prefix_cache_blocks,
        budget_mib=config.prefix_cache_mib,
        default=gen.slots * gen.max_len // block,
    )
    prefix = PrefixCache(gen, blocks=blocks, block=block, index=rank0)
    if rank0:
        print(
            f"neuron-tp serve: prefix cache of {blocks} blocks x {block} tokens, "
            f"{prefix.nbytes / 2**20:.1f} MiB per rank",
            flush=True,
        )
    return prefix

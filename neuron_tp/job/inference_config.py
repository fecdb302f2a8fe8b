"""``neuron-tp generate`` and ``neuron-tp serve``'s options: :class:`GenerateConfig` and
:class:`ServeConfig`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from .common_config import CommonConfig
from .options import buckets, group, non_negative, opt
from .options import positive as pos


def _batch_buckets(batching: str):
    return opt(
        "--batch-buckets",
        buckets("1,2,4,8"),
        f"comma-separated batch sizes (graph shapes); {batching}",
        type=buckets,
    )


_BUCKETS: dict[str, Any] = dict(help="comma-separated prompt length buckets", type=buckets)
_DTYPE: dict[str, Any] = dict(choices=("float32", "bfloat16"))
_ADAPTER = (
    "a PEFT LoRA adapter directory, merged into --model (a HF directory or preset) "
    "on load; a LoRA run's checkpoint needs none (its adapters are merged)"
)


_QUANTIZE_HELP = (
    "int8: weight-only int8 linear layers (one symmetric scale per output channel, "
    "dequantized inside the graph; the LM head and embeddings stay in --dtype)"
)


_DRAFT_HELP = (
    "speculative decoding: a smaller causal LM with the same tokenizer and vocabulary (a "
    "preset, HF directory or neuron_tp checkpoint, sharded at --tp like --model) proposes "
    "--speculation-length tokens per slot and step; the model verifies them all in one "
    "forward (greedy: the same tokens as without a draft; sampled: the same distribution)"
)
_SPECULATION_HELP = (
    "with --draft-model or --speculation-method ngram: tokens proposed per slot and step (K)"
)
_METHOD_HELP = (
    "where proposals come from: draft (--draft-model; the default with one) or ngram (no "
    "second model: the tokens that followed the last --prompt-lookup-max..min tokens' most "
    "recent earlier occurrence in the request's own prompt and output; for repetitive text)"
)


def _draft_model():  # None: no speculation (neuron_tp.infer.speculative)
    return opt("--draft-model", None, _DRAFT_HELP, metavar="DIR")


def _speculation_length():
    return opt("--speculation-length", 4, _SPECULATION_HELP, type=pos(int), metavar="K")


_KV_SPLIT_HELP = (
    "the KV cache of a model with fewer kv heads than --tp (each kv head replicated on tp/kv "
    "ranks): sequence: the ranks sharing a kv head each hold 1/r of the positions (long "
    "prompts; attention combined across them); heads: each rank holds its heads' whole "
    "cache; auto: in serve, sequence when kv heads are replicated; in generate, heads (its "
    "static batches)"
)


def _kv_split():  # neuron_tp.infer.kv_split
    return opt("--kv-split", "auto", _KV_SPLIT_HELP, choices=("auto", "heads", "sequence"))


def _speculation_method():  # None: "draft" with --draft-model, else no speculation
    return opt("--speculation-method", None, _METHOD_HELP, choices=("draft", "ngram"))


def _prompt_lookup(bound: str, default: int):  # neuron_tp.infer.ngram
    return opt(
        f"--prompt-lookup-{bound}",
        default,
        f"with --speculation-method ngram: the {'longest' if bound == 'max' else 'shortest'} "
        "suffix of a request's text looked up",
        type=pos(int),
        metavar="N",
    )


@dataclass(frozen=True)
class ModelLoadConfig(CommonConfig):
    """The options ``generate`` and ``serve`` share: how the model is loaded (dtype, an
    adapter, int8 weights), the KV cache's split and speculation."""

    buckets: list[int] = opt("--buckets", buckets("32,128,512"), **_BUCKETS)  # sorted
    dtype: str = opt("--dtype", "float32", **_DTYPE)
    adapter: str | None = opt("--adapter", None, _ADAPTER, metavar="DIR")  # merged on load
    quantize: str = opt(  # "int8": weight-only int8 linears (neuron_tp.layers.quantized)
        "--quantize", "none", _QUANTIZE_HELP, choices=("none", "int8")
    )
    draft_model: str | None = _draft_model()
    speculation_length: int = _speculation_length()
    kv_split: str = _kv_split()
    speculation_method: str | None = _speculation_method()
    prompt_lookup_max: int = _prompt_lookup("max", 4)
    prompt_lookup_min: int = _prompt_lookup("min", 1)


@dataclass(frozen=True)
class GenerateConfig(ModelLoadConfig):
    """``neuron-tp generate`` options (tp ranks launched by torchrun)."""

    PROG: ClassVar[str] = "neuron-tp generate"
    DESCRIPTION: ClassVar[str] = "Sharded generation with static shapes."

    prompt: list[str] = opt("--prompt", [], "a prompt (repeatable)", action="append")
    prompts_file: str | None = opt("--prompts-file", None, "one prompt per line")
    max_new_tokens: int = opt("--max-new-tokens", 32, type=pos(int))
    batch_buckets: list[int] = _batch_buckets(  # sorted; more prompts: several batches
        "more prompts run in several batches"
    )
    do_sample: bool = opt("--do-sample", False, action="store_true")
    temperature: float = opt("--temperature", 1.0, type=pos(float))
    top_k: int = opt("--top-k", 0, "0 = no top-k filter", type=non_negative(int))
    stop: list[str] = opt(  # the text is cut before the first one
        "--stop", [], "stop string (repeatable): text ends before it", action="append"
    )
    ignore_eos: bool = opt(  # always generate --max-new-tokens (benchmarks)
        "--ignore-eos",
        False,
        "do not stop at EOS (always --max-new-tokens)",
        action="store_true",
    )


@dataclass(frozen=True)
class ServeLoraConfig:
    """Many LoRA adapters behind one server (vLLM's options): chosen per request by
    ``model``, several in one batch, loaded and unloaded at run time."""

    TITLE: ClassVar[str] = "LoRA adapters (a request names one as its model)"

    enable_lora: bool = opt(  # implied by --lora-modules
        "--enable-lora",
        False,
        "serve LoRA adapters of --model: those of --lora-modules and any POSTed to "
        "/v1/load_lora_adapter",
        action="store_true",
    )
    lora_modules: list[str] = opt(  # NAME=DIR or {"name": .., "path": ..}
        "--lora-modules",
        [],
        "adapters served from the start: NAME=DIR (a PEFT adapter directory) or JSON "
        '{"name": NAME, "path": DIR}',
        nargs="+",
        metavar="NAME=DIR",
    )
    max_loras: int = opt(  # the bank's slots (hf.lora_bank)
        "--max-loras",
        1,
        "adapters resident on the device at once (in one batch); others wait for a slot",
        type=pos(int),
    )
    max_lora_rank: int = opt(  # every slot is padded to it
        "--max-lora-rank", 16, "the largest adapter rank accepted", type=pos(int)
    )
    max_cpu_loras: int | None = opt(  # None: --max-loras
        "--max-cpu-loras",
        None,
        "adapters kept read in host memory (default: --max-loras); others are read again "
        "from their directory when needed",
        type=pos(int),
    )

    @property
    def on(self) -> bool:
        """Whether the server serves adapters."""
        return self.enable_lora or bool(self.lora_modules)


@dataclass(frozen=True)
class ServeConfig(ModelLoadConfig):
    """``neuron-tp serve`` options (tp ranks launched by torchrun; rank 0 serves HTTP)."""

    PROG: ClassVar[str] = "neuron-tp serve"
    DESCRIPTION: ClassVar[str] = "An OpenAI-compatible HTTP server for sharded generation."

    host: str = opt("--host", "127.0.0.1", "address to listen on (0.0.0.0: all)")
    port: int = opt("--port", 8000, "HTTP port", type=non_negative(int))
    max_new_tokens: int = opt(  # the most a request may ask for (sets the cache length)
        "--max-new-tokens",
        256,
        "the largest max_tokens a request may ask for (sets the KV cache length)",
        type=pos(int),
    )
    batch_buckets: list[int] = _batch_buckets(  # sorted: concurrent requests share a batch
        "the largest is the number of decode slots (requests generating at once); decode "
        "graphs exist for each"
    )
    prefill_chunk: int = opt(  # longer prompts: several steps
        "--prefill-chunk",
        256,
        "prompt tokens prefilled per step (capped to the largest --buckets): a longer "
        "prompt is prefilled over several steps, between the running requests' tokens",
        type=pos(int),
    )
    prefix_caching: bool = opt(  # neuron_tp.infer.prefix_cache
        "--prefix-caching",
        True,
        "copy the KV of prompt blocks computed before (same tokens from the start) into a "
        "new request's slot instead of prefilling them again (tokens unchanged; with "
        "--draft-model the draft's KV too; split by sequence, each rank its own positions)",
        action=argparse.BooleanOptionalAction,
    )
    prefix_block: int = opt(  # 0: the largest divisor of the chunk <= 32
        "--prefix-block",
        0,
        "tokens per cached block; must divide the prefill chunk (default: its largest "
        "divisor <= 32)",
        type=non_negative(int),
    )
    prefix_cache_blocks: int = opt(  # 0: --prefix-cache-mib, else as many as the slot cache
        "--prefix-cache-blocks",
        0,
        "cached blocks on each rank (default: --prefix-cache-mib, else the positions of "
        "all slots: the KV cache's memory again)",
        type=non_negative(int),
    )
    prefix_cache_mib: float = opt(  # a bound on the pool's device memory per rank
        "--prefix-cache-mib",
        0.0,
        "device memory per rank the cached blocks may take (MiB; instead of --prefix-cache-blocks)",
        type=non_negative(float),
    )
    served_model_name: str | None = opt(  # None: --model
        "--served-model-name", None, "the model id clients use (default: --model)"
    )
    tool_call_parser: str = opt(  # how tool_choice "auto" finds calls in the model's text
        "--tool-call-parser",
        "hermes",
        "the model's tool-call format for tool_choice auto: hermes (<tool_call>{json}"
        "</tool_call>, Hermes / Qwen) or llama3_json (a JSON object, Llama 3)",
        choices=("hermes", "llama3_json"),
    )
    warmup: str = opt(  # graphs captured before ready: "smallest" shapes or "all" buckets
        "--warmup",
        "smallest",
        "graphs captured (compiled) before /ready: the smallest batch and prompt shape, "
        "or every batch x prompt bucket (no compile while serving, except for new top_k)",
        choices=("smallest", "all"),
    )
    max_queue: int = opt(  # more get 429
        "--max-queue",
        256,
        "requests that may wait to run; more get 429 with Retry-After",
        type=pos(int),
    )
    request_timeout_s: float = opt(  # admission to the last token; then 504 / a stream error
        "--request-timeout-s",
        600.0,
        "a request not finished this long after it arrived is cancelled (504, or an "
        "error event ending its stream)",
        type=pos(float),
    )
    max_body_bytes: int = opt(  # larger request bodies get 413
        "--max-body-bytes",
        4 * 1024 * 1024,
        "larger request bodies get 413 (default 4 MiB)",
        type=pos(int),
    )
    lora: ServeLoraConfig = group(ServeLoraConfig)
    api_key: str | None = opt(  # None: $NEURON_TP_API_KEY, else no key asked
        "--api-key",
        None,
        "every path but /health, /ready and /metrics needs 'Authorization: Bearer KEY' "
        "(else 401); default: $NEURON_TP_API_KEY, unset = no key",
    )

    @property
    def model_name(self) -> str:
        """The model id clients see (``/v1/models``, responses)."""
        return self.served_model_name or self.model

    @property
    def prefix_cache_on(self) -> bool:
        """Whether the server caches prompt blocks (``--prefix-caching``, on by default)."""
        return self.prefix_caching

    def generate_config(self) -> GenerateConfig:
        """The equivalent ``neuron-tp generate`` options (for loading the model): the shared
        ones (:class:`ModelLoadConfig`'s fields, and ``--max-new-tokens`` and
        ``--batch-buckets``, which both declare), the others at their defaults."""
        names = [f.name for f in fields(ModelLoadConfig)] + ["max_new_tokens", "batch_buckets"]
        return GenerateConfig(**{name: getattr(self, name) for name in names})

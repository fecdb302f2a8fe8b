"""What ``neuron-tp serve`` reports: Prometheus metrics (``GET /metrics``, with
``prometheus_client``, imported lazily) and one log line per finished request.

Metrics (each app has its own registry: nothing is module-global):

- ``neuron_tp_requests_total{endpoint, status}``: HTTP responses by route and status code
  (a path no route serves counts as ``endpoint="other"``);
- ``neuron_tp_queue_depth``, ``neuron_tp_slots_in_use``: gauges read from the engine at
  scrape time (requests waiting; requests of the running batch);
- ``neuron_tp_time_to_first_token_seconds``: admission to the first output of a request;
- ``neuron_tp_time_per_output_token_seconds``: per choice, (last - first output) / (tokens - 1);
- ``neuron_tp_request_duration_seconds``: admission to the end of a generation request;
- ``neuron_tp_prompt_tokens_total``, ``neuron_tp_generation_tokens_total``: tokens of the
  choices that finished;
- with prefix caching (read from rank 0's index at scrape time):
  ``neuron_tp_prefix_cache_hit_rate`` (hit tokens / prompt tokens of the requests admitted),
  ``neuron_tp_prefix_cache_hit_tokens_total``, ``neuron_tp_prefix_cache_prompt_tokens_total``,
  ``neuron_tp_prefix_cache_blocks`` (cached now), ``neuron_tp_prefix_cache_capacity_blocks``,
  ``neuron_tp_prefix_cache_evictions_total``.
- with ``--draft-model`` (speculative decoding; 0 without): ``neuron_tp_speculation_proposed_
  tokens`` and ``..._accepted_tokens`` (draft tokens proposed, accepted by the model),
  ``..._acceptance_ratio`` (accepted / proposed), ``..._tokens_per_step`` (tokens a slot gets
  per forward of the model: 1..K+1), read from the engine at scrape time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .prefix_cache import PrefixStats
from .schedule import Done, Event, Prompt

LOG = logging.getLogger("neuron_tp.serve")
# seconds; a NeuronCore's token is ~ms, a CPU's or a long queue's far more
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

# (name, help, attribute of infer.speculative.SpeculationStats)
SPECULATION_GAUGES = (
    ("proposed_tokens", "Draft tokens proposed (speculative decoding)", "proposed"),
    ("accepted_tokens", "Draft tokens the model accepted", "accepted"),
    ("acceptance_ratio", "Accepted / proposed draft tokens", "acceptance"),
    ("tokens_per_step", "Tokens a slot gets per forward of the model", "tokens_per_step"),
)


def _reader(source: Callable[[], object], attr: str) -> Callable[[], float]:
    """``source().attr`` as a float at each scrape (0 when there is no source)."""
    return lambda: float(getattr(source(), attr, 0))


class ServerMetrics:
    """The Prometheus metrics of one server app, in a registry of its own."""

    def __init__(
        self,
        queue_depth: Callable[[], int],
        slots_in_use: Callable[[], int],
        *,
        prefix: Callable[[], PrefixStats | None] = lambda: None,
        speculation: Callable[[], object] = lambda: None,
    ):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "neuron_tp_requests",
            "HTTP responses by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        queue = Gauge("neuron_tp_queue_depth", "Requests waiting to run", registry=r)
        queue.set_function(lambda: float(queue_depth()))
        slots = Gauge("neuron_tp_slots_in_use", "Requests being generated", registry=r)
        slots.set_function(lambda: float(slots_in_use()))
        self.ttft = Histogram(
            "neuron_tp_time_to_first_token_seconds",
            "Admission to the first output of a generation request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "neuron_tp_time_per_output_token_seconds",
            "Per choice: (last output - first output) / (tokens - 1)",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "neuron_tp_request_duration_seconds",
            "Admission to the end of a generation request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        for name, what, attr in SPECULATION_GAUGES:
            gauge = Gauge(f"neuron_tp_speculation_{name}", what, registry=r)
            gauge.set_function(_reader(speculation, attr))
        self.prompt_tokens = Counter(
            "neuron_tp_prompt_tokens", "Prompt tokens of finished choices", registry=r
        )
        self.generation_tokens = Counter(
            "neuron_tp_generation_tokens", "Generated tokens of finished choices", registry=r
        )
        r.register(_PrefixCollector(prefix))

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition (body, content type) in the format the ``Accept`` header asks for
        (Prometheus text by default)."""
        from prometheus_client.exposition import choose_encoder

        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type


class _PrefixCollector:
    """The prefix-cache metrics, from ``stats()`` at each scrape (none without caching)."""

    def __init__(self, stats: Callable[[], PrefixStats | None]):
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats()
        if s is None:
            return
        name = "neuron_tp_prefix_cache_"
        yield GaugeMetricFamily(
            name + "hit_rate", "Prompt tokens copied from the cache / prompt tokens", s.hit_rate
        )
        yield CounterMetricFamily(
            name + "hit_tokens", "Prompt tokens copied from the cache", s.hit_tokens
        )
        yield CounterMetricFamily(
            name + "prompt_tokens", "Prompt tokens of the requests admitted", s.prompt_tokens
        )
        yield GaugeMetricFamily(name + "blocks", "Cached prompt blocks", s.cached_blocks)
        yield GaugeMetricFamily(name + "capacity_blocks", "Blocks of the pool", s.capacity)
        yield CounterMetricFamily(name + "evictions", "Cached blocks evicted (LRU)", s.evictions)


class RequestTrace:
    """One generation request, from admission to its end: its choices' first outputs and
    usage, observed into the metrics and logged once by :meth:`finish`."""

    def __init__(self, metrics: ServerMetrics, request_id: str):
        self.metrics, self.id = metrics, request_id
        self.start = time.monotonic()
        self.first: dict[int, float] = {}  # choice -> time of its first output
        self.done: dict[int, tuple[Done, float]] = {}  # choice -> its Done event and when
        self.choices = 0  # set once the request's prompts are known
        self.finished = False

    def event(self, index: int, event: Event) -> None:
        """Note an engine event of choice ``index``."""
        now = time.monotonic()
        if isinstance(event, Prompt):  # the prompt's log-probabilities: no token yet
            return
        self.first.setdefault(index, now)
        if isinstance(event, Done):
            self.done[index] = (event, now)

    def finish(self, status: int, note: str | None = None) -> None:
        """Observe and log the request (once): ``status`` its HTTP status, ``note`` why it
        ended early (``timeout``, ``error``, ``disconnected``; shown for unfinished choices)."""
        if self.finished:
            return
        self.finished = True
        m, end = self.metrics, time.monotonic()
        prompt = sum(d.prompt_tokens for d, _ in self.done.values())
        completion = sum(d.completion_tokens for d, _ in self.done.values())
        ttft = min(self.first.values()) - self.start if self.first else None
        if ttft is not None:
            m.ttft.observe(ttft)
        if self.first or self.done:
            m.duration.observe(end - self.start)
        for i, (d, at) in self.done.items():
            if d.completion_tokens > 1:
                m.tpot.observe((at - self.first[i]) / (d.completion_tokens - 1))
        m.prompt_tokens.inc(prompt)
        m.generation_tokens.inc(completion)
        choices = max([self.choices - 1, *self.first, *self.done], default=-1) + 1
        ended = {i: d.finish_reason for i, (d, _) in self.done.items()}
        reasons = [ended.get(i, note) for i in range(choices)]
        LOG.info(
            "request %s status=%d prompt_tokens=%d completion_tokens=%d ttft_ms=%s "
            "duration_ms=%.1f finish_reason=%s",
            self.id,
            status,
            prompt,
            completion,
            "-" if ttft is None else f"{ttft * 1000:.1f}",
            (end - self.start) * 1000,
            ",".join(str(r) for r in reasons) or note or "-",
        )

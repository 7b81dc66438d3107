"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own."""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lora_graph.engine import LLMEngine, RequestOutput


def _advance(counter: Counter, new: int, old: int) -> None:
    """Move a Prometheus counter to an engine total it mirrors (``old``: its last value)."""
    if new > old:
        counter.inc(new - old)


class Metrics:
    """The server's Prometheus metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lora_graph_requests",
            "Finished engine requests (each of a request's n choices counts)",
            ["adapter", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "lora_graph_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            "lora_graph_generation_tokens", "Generated tokens", registry=r
        )
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram(
            "lora_graph_time_to_first_token_seconds", "Arrival to first token", buckets=buckets,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "lora_graph_inter_token_latency_seconds", "Between tokens of a request",
            buckets=buckets, registry=r,
        )  # fmt: skip
        self.running = Gauge("lora_graph_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("lora_graph_requests_waiting", "Requests waiting", registry=r)
        self.kv_pages_used = Gauge("lora_graph_kv_pages_used", "KV cache pages in use", registry=r)
        self.kv_pages_total = Gauge("lora_graph_kv_pages_total", "KV cache pages", registry=r)
        self.slot_hits = Counter(
            "lora_graph_lora_slot_hits", "Adapter activations that found it in a slot", registry=r
        )
        self.slot_misses = Counter(
            "lora_graph_lora_slot_misses", "Adapter activations that copied it in", registry=r
        )
        self.slot_evictions = Counter(
            "lora_graph_lora_slot_evictions", "Adapters evicted from a slot", registry=r
        )
        self._slot_counts = (0, 0, 0)
        self.prefix_cached = Counter(
            "lora_graph_prompt_tokens_cached",
            "Prompt tokens reused from the prefix cache (at a request's first admission)",
            ["adapter"],
            registry=r,
        )
        self.prefix_computed = Counter(
            "lora_graph_prompt_tokens_computed",
            "Prompt tokens computed (not found in the prefix cache) at a request's first admission",
            ["adapter"],
            registry=r,
        )
        self.kv_pages_cached = Gauge(
            "lora_graph_kv_pages_cached", "KV cache pages keyed for reuse (held or idle)",
            registry=r,
        )  # fmt: skip
        self._prefix_counts: dict[str, tuple[int, int]] = {}
        self.adapter_load = Histogram(
            "lora_graph_adapter_load_seconds", "Runtime adapter loads", buckets=buckets,
            registry=r,
        )  # fmt: skip

    def observe_engine(self, engine: LLMEngine) -> None:
        """Gauges from the engine's state (engine thread)."""
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        pages = engine.pages
        self.kv_pages_total.set(pages.capacity)
        self.kv_pages_used.set(pages.capacity - pages.num_free)
        now = engine.lora_slot_counts()
        for counter, new, old in zip(
            (self.slot_hits, self.slot_misses, self.slot_evictions),
            now,
            self._slot_counts,
            strict=True,
        ):
            _advance(counter, new, old)
        self._slot_counts = now
        self.kv_pages_cached.set(pages.num_cached)
        counts = engine.prefix_cache_counts()
        for name, (cached, computed) in counts.items():
            if name not in self._prefix_counts:  # both series from the adapter's first request
                self.prefix_cached.labels(name)
                self.prefix_computed.labels(name)
            was_cached, was_computed = self._prefix_counts.get(name, (0, 0))
            _advance(self.prefix_cached.labels(name), cached, was_cached)
            _advance(self.prefix_computed.labels(name), computed, was_computed)
        self._prefix_counts = counts

    def observe_finished(self, out: RequestOutput, outcome: str | None = None) -> None:
        outcome = outcome or out.finish_reason or ("aborted" if out.error == "aborted" else "error")
        self.requests.labels(out.adapter or "base", outcome).inc()
        times = out.token_times
        if out.arrival_time is not None and times:
            self.ttft.observe(times[0] - out.arrival_time)
        for a, b in itertools.pairwise(times):
            self.itl.observe(b - a)

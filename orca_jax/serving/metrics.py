"""The server's Prometheus metrics (`/metrics`, prometheus-client's text format).

Gauges are set by the engine thread after each iteration; the histograms are the
server's side of each request's latency: TTFT from the request's arrival at the
engine thread to its first token reaching the host, and the gap between tokens
reaching the host (with overlap a token reaches the host one step after it was
sampled, so both include up to one step's latency more than the step that sampled
it). Names follow vLLM's where one exists (`orca_jax:` for `vllm:`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
TOKENS_PER_S_WINDOW_S = 10.0  # the window of the tokens-per-second gauge


class ServingMetrics:
    """The metrics of one server, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.waiting = Gauge("orca_jax:num_requests_waiting", "Requests arrived and not "
                             "running (new, or preempted).", registry=r)
        self.running = Gauge("orca_jax:num_requests_running", "Requests admitted, holding KV "
                             "pages.", registry=r)
        self.outstanding = Gauge("orca_jax:num_requests_outstanding", "Requests the server "
                                 "holds: submitted and not yet answered in full.", registry=r)
        self.pages_used = Gauge("orca_jax:kv_pages_used", "KV pages in use.", registry=r)
        self.pages_free = Gauge("orca_jax:kv_pages_free", "KV pages free.", registry=r)
        self.preemptions = Gauge("orca_jax:num_preemptions", "Preemptions since the start "
                                 "(a counter's value, read from the scheduler).", registry=r)
        self.steps = Gauge("orca_jax:num_steps", "Engine steps since the start.", registry=r)
        self.tokens_per_s = Gauge("orca_jax:generation_tokens_per_second", "Tokens reaching "
                                  f"the host per second over the last {TOKENS_PER_S_WINDOW_S:g} "
                                  "s.", registry=r)
        self.generated = Counter("orca_jax:generation_tokens", "Tokens generated and handed "
                                 "to clients.", registry=r)
        self.finished = Counter("orca_jax:request_finished", "Requests answered in full, "
                                "stopped, cancelled or rejected.", registry=r)
        self.ttft = Histogram("orca_jax:time_to_first_token_seconds", "Arrival to the first "
                              "token reaching the host.", buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("orca_jax:inter_token_latency_seconds", "Gap between a request's "
                             "tokens reaching the host.", buckets=_ITL_BUCKETS, registry=r)
        self._recent: deque[tuple[float, int]] = deque()

    # ---- the engine thread's observer (LiveRun.metrics)
    def iteration(self, live: Any) -> None:
        scheduler = live.scheduler
        self.waiting.set(scheduler.waiting.size)
        self.running.set(scheduler.running.size)
        self.outstanding.set(live.num_outstanding)
        self.pages_used.set(scheduler.kv.num_used)
        self.pages_free.set(scheduler.kv.num_free)
        self.preemptions.set(scheduler.record.num_preemptions)
        self.steps.set(scheduler.num_steps)
        self._rate(0)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.generated.inc()
        self._rate(1)

    def tokens(self, count: int, gap_s: float) -> None:
        for _ in range(count):
            self.itl.observe(gap_s)
        self.generated.inc(count)
        self._rate(count)

    def request_done(self) -> None:
        self.finished.inc()

    def _rate(self, count: int) -> None:
        now = time.monotonic()
        recent = self._recent
        if count:
            recent.append((now, count))
        while recent and recent[0][0] < now - TOKENS_PER_S_WINDOW_S:
            recent.popleft()
        self.tokens_per_s.set(sum(c for _, c in recent) / TOKENS_PER_S_WINDOW_S)

    def text(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

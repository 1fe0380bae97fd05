"""What the server has done, in Prometheus' text format (GET /metrics), through prometheus_client:
requests running and waiting and the engine's steps by mode (the speculation policy's choices;
read from the engine when scraped), tokens in and out, requests finished by reason, and histograms of the accepted length (a request's tokens per step), time to
first token, time per output token and batch occupancy (the share of the batch limit a step
decodes). Written from the engine's thread and the event loop's."""

from __future__ import annotations

from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds
PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)  # seconds
ACCEPTED = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32)  # tokens
OCCUPANCY = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)  # share of the batch limit
REASONS = ("stop", "length", "aborted", "failed")  # how a request ended: as OpenAI says, a disconnect, a fault

prometheus_client.disable_created_metrics()  # (no *_created series: the names stay those above)


class _Steps:
    """specgraph_steps_total{mode}: the engine's steps so far by mode, read when scraped."""

    def __init__(self, modes: Callable[[], dict[str, int]]):
        self.modes = modes

    def collect(self):
        family = CounterMetricFamily("specgraph_steps", "engine steps by mode: ar (plain decoding), depth D "
                                     "(speculation with the drafter's tree cut to depth D)", labels=["mode"])
        for mode, steps in self.modes().items():
            family.add_metric([mode], steps)
        yield family


class Metrics:
    def __init__(self, limit: int, counts: Callable[[], tuple[int, int]], modes: Callable[[], dict[str, int]] = dict):
        """`limit`: requests decoded at once at most; `counts()`: the engine's (running, waiting) requests now;
        `modes()`: its steps so far by mode."""
        self.registry = CollectorRegistry()
        self.registry.register(_Steps(modes))
        registered = {"registry": self.registry}
        Gauge("specgraph_requests_running", "requests being decoded", **registered).set_function(lambda: counts()[0])
        Gauge("specgraph_requests_waiting", "requests waiting for a place in the batch",
              **registered).set_function(lambda: counts()[1])
        Gauge("specgraph_batch_limit", "requests decoded at once at most", **registered).set(limit)
        self.prompt_tokens = Counter("specgraph_prompt_tokens", "prompt tokens of the requests admitted", **registered)
        self.generation_tokens = Counter("specgraph_generation_tokens", "tokens generated", **registered)
        self.finished = Counter("specgraph_requests_finished", "requests ended, by how: stop, length, aborted (the "
                                "client left, or the server stopped), failed (a fault)", ["reason"], **registered)
        for reason in REASONS:
            self.finished.labels(reason)
        self.accepted = Histogram("specgraph_accepted_length", "tokens a step committed to a request",
                                  buckets=ACCEPTED, **registered)
        self.ttft = Histogram("specgraph_time_to_first_token_seconds", "request received to its first token",
                              buckets=LATENCY, **registered)
        self.tpot = Histogram("specgraph_time_per_output_token_seconds",
                              "a request's time after its first token, per token after the first", buckets=PER_TOKEN,
                              **registered)
        self.occupancy = Histogram("specgraph_batch_occupancy", "requests a step decoded, over the batch limit",
                                   buckets=OCCUPANCY, **registered)

    def step(self, accepted: list[int], limit: int) -> None:
        """A step that brought each of its requests `accepted` tokens (engine thread)."""
        self.occupancy.observe(len(accepted) / limit)
        for n in accepted:
            self.accepted.observe(n)
        self.generation_tokens.inc(sum(accepted))

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def ended(self, reason: str, per_token: float | None = None) -> None:
        """A request ended (`reason`: one of REASONS); `per_token`: its time per output token, if it had two or more."""
        self.finished.labels(reason).inc()
        if per_token is not None:
            self.tpot.observe(per_token)

    def text(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)

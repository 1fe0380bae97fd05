"""What the server has done, in Prometheus' text format (GET /metrics): requests running and
waiting, tokens in and out, requests finished by reason, and histograms of the accepted length (a
request's tokens per step), time to first token, time per output token and batch occupancy (the
share of the batch limit a step decodes). Written from the engine's thread and the event loop's."""

from __future__ import annotations

import bisect
import threading

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds
PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)  # seconds
ACCEPTED = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32)  # tokens
OCCUPANCY = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)  # share of the batch limit
REASONS = ("stop", "length", "aborted", "failed")  # how a request ended: as OpenAI says, a disconnect, a fault


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self) -> list[str]:
        out, total = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"], 0
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self.counts):
            total += count
            out.append(f'{self.name}_bucket{{le="{bound}"}} {total}')
        return [*out, f"{self.name}_sum {self.sum}", f"{self.name}_count {total}"]


class Metrics:
    def __init__(self, limit: int):
        self._lock = threading.Lock()
        self.limit = limit  # requests decoded at once at most
        self.running = self.waiting = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.finished = dict.fromkeys(REASONS, 0)
        self.accepted = Histogram("specgraph_accepted_length", "tokens a step committed to a request", ACCEPTED)
        self.ttft = Histogram("specgraph_time_to_first_token_seconds", "request received to its first token", LATENCY)
        self.tpot = Histogram("specgraph_time_per_output_token_seconds",
                              "a request's time after its first token, per token after the first", PER_TOKEN)
        self.occupancy = Histogram("specgraph_batch_occupancy", "requests a step decoded, over the batch limit",
                                   OCCUPANCY)

    def queue(self, running: int, waiting: int) -> None:
        """The engine's requests now (engine thread)."""
        self.running, self.waiting = running, waiting

    def step(self, accepted: list[int], limit: int) -> None:
        """A step that brought each of its requests `accepted` tokens (engine thread)."""
        with self._lock:
            self.occupancy.observe(len(accepted) / limit)
            for n in accepted:
                self.accepted.observe(n)
            self.generation_tokens += sum(accepted)

    def admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def ended(self, reason: str, per_token: float | None = None) -> None:
        """A request ended (`reason`: one of REASONS); `per_token`: its time per output token, if it had two or more."""
        with self._lock:
            self.finished[reason] += 1
            if per_token is not None:
                self.tpot.observe(per_token)

    def text(self) -> str:
        with self._lock:
            lines = [
                "# HELP specgraph_requests_running requests being decoded", "# TYPE specgraph_requests_running gauge",
                f"specgraph_requests_running {self.running}",
                "# HELP specgraph_requests_waiting requests waiting for a place in the batch",
                "# TYPE specgraph_requests_waiting gauge", f"specgraph_requests_waiting {self.waiting}",
                "# HELP specgraph_batch_limit requests decoded at once at most", "# TYPE specgraph_batch_limit gauge",
                f"specgraph_batch_limit {self.limit}",
                "# HELP specgraph_prompt_tokens_total prompt tokens of the requests admitted",
                "# TYPE specgraph_prompt_tokens_total counter", f"specgraph_prompt_tokens_total {self.prompt_tokens}",
                "# HELP specgraph_generation_tokens_total tokens generated",
                "# TYPE specgraph_generation_tokens_total counter",
                f"specgraph_generation_tokens_total {self.generation_tokens}",
                "# HELP specgraph_requests_finished_total requests ended, by how: stop, length, aborted "
                "(the client left, or the server stopped), failed (a fault)",
                "# TYPE specgraph_requests_finished_total counter",
                *(f'specgraph_requests_finished_total{{reason="{r}"}} {n}' for r, n in self.finished.items()),
                *self.accepted.lines(), *self.ttft.lines(), *self.tpot.lines(), *self.occupancy.lines(),
            ]
        return "\n".join(lines) + "\n"

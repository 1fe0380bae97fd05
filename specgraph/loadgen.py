"""`specgraph loadgen`: load on any OpenAI-compatible completions endpoint, measured as `vllm bench
serve` measures it. Requests arrive as a Poisson process at --rate R (or all at once), or --concurrency
C are kept in flight; each is streamed, so that every chunk's arrival is seen.

Per request: TTFT, the time from sending it to its first text; TPOT, its time after that over its
output tokens after the first; inter-token latencies, the gaps between its chunks of text (a
speculative step may bring several tokens in one chunk); end-to-end latency. Output tokens are
the server's usage counts (asked for with stream_options.include_usage), else the chunks of text.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from specgraph.errors import SpecgraphError

TIMEOUT = 600.0  # seconds to wait for a server's next bytes before a request counts as failed


@dataclass(frozen=True)
class LoadSpec:
    url: str
    prompts: list[str]  # taken in turn
    requests: int
    rate: float | None  # Poisson arrivals per second; None (and no concurrency): all at once
    concurrency: int | None  # requests kept in flight
    max_tokens: int
    model: str | None  # None: the server's first
    api_key: str | None
    allow_remote: bool
    seed: int  # of the arrival times


@dataclass
class Outcome:
    """One request, its times in seconds from the run's start or from its own sending."""

    sent: float = 0.0  # from the run's start
    ttft: float | None = None
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk of text, from sending
    e2e: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    error: str | None = None


def endpoints(url: str) -> tuple[str, str]:
    """A server's URL (its root, its /v1, or its completions endpoint) -> (completions URL, models URL)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SpecgraphError(f"URL: {url!r} is not an http(s) URL; e.g. http://127.0.0.1:8000")
    root = url.rstrip("/").removesuffix("/completions").removesuffix("/v1")
    return f"{root}/v1/completions", f"{root}/v1/models"


def on_this_machine(host: str) -> bool:
    """Whether every address `host` names is this machine's: a loopback address, or one a socket
    here can bind to (only a machine's own addresses can be bound)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise SpecgraphError(f"URL: cannot resolve {host!r} ({exc.strerror})") from None
    for family, _, _, _, address in found:
        if ipaddress.ip_address(address[0].split("%")[0]).is_loopback:
            continue
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address[0], 0))
        except OSError:
            return False
    return True


async def _served_model(client, url: str, given: str | None) -> str:
    """The model to ask for: `given`, or the first the server lists at `url` (its /v1/models); a
    one-line error where no server answers there, or (none given) it lists none."""
    import httpx

    try:
        response = await client.get(url)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise SpecgraphError(f"URL: no server answers at {url.removesuffix('/v1/models')} ({exc or type(exc).__name__}); "
                             "start one (`specgraph serve RECIPE`), or give the URL it listens at") from None
    except httpx.HTTPError as exc:
        raise SpecgraphError(f"URL: GET {url} failed ({type(exc).__name__}: {exc})") from None
    if given is not None:
        return given
    try:
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001 - any failure here: the server does not list a model
        raise SpecgraphError(f"URL: GET {url} gave no model ({type(exc).__name__}: {exc}); give --model") from None


async def _request(client, url: str, payload: dict, began: float) -> Outcome:
    """Send one streamed completion request -> its Outcome (failed: `error` says why)."""
    start = time.perf_counter()
    out = Outcome(sent=start - began)
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {body[:200]}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"error event: {chunk['error'].get('message')}"
                    return out
                if chunk.get("usage"):
                    out.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    out.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    now = time.perf_counter() - start
                    out.ttft = now if out.ttft is None else out.ttft
                    out.chunks.append(now)
    except Exception as exc:  # noqa: BLE001 - a request that fails is a measurement, not the end of the run
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.e2e = time.perf_counter() - start
    out.output_tokens = out.output_tokens or len(out.chunks)
    if out.ttft is None:
        out.error = "no text came"
    return out


def _client(spec: LoadSpec):
    import httpx

    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    # no pool limit: a request waiting for a connection would count the wait as the server's
    return httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(TIMEOUT, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def _model(spec: LoadSpec, models: str) -> str:
    async with _client(spec) as client:
        return await _served_model(client, models, spec.model)


async def _drive(spec: LoadSpec, completions: str, model: str, bar) -> tuple[list[Outcome], float]:
    """Send every request as the spec paces them -> (outcomes in sending order, seconds from the
    first sent to the last answered)."""
    async with _client(spec) as client:
        gate = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
        arrivals = random.Random(spec.seed)

        async def one(i: int) -> Outcome:
            payload = {"model": model, "prompt": spec.prompts[i % len(spec.prompts)], "max_tokens": spec.max_tokens,
                       "stream": True, "stream_options": {"include_usage": True}}
            if gate is None:
                out = await _request(client, completions, payload, began)
            else:
                async with gate:
                    out = await _request(client, completions, payload, began)
            bar.update()
            return out

        began, due, tasks = time.perf_counter(), 0.0, []
        for i in range(spec.requests):
            if spec.rate is not None and i > 0:
                due += arrivals.expovariate(spec.rate)  # (absolute times: a late wake-up does not shift the rest)
                await asyncio.sleep(max(0.0, due - (time.perf_counter() - began)))
            tasks.append(asyncio.ensure_future(one(i)))
        outcomes = await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - began


def _stats(values: list[float]) -> dict[str, float] | None:
    """mean, median and p99 (linear interpolation) of `values` in seconds, as milliseconds; None if none."""
    if not values:
        return None
    ordered = sorted(values)

    def quantile(q: float) -> float:
        at = q * (len(ordered) - 1)
        low = int(at)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (at - low)

    return {"mean": 1000 * sum(ordered) / len(ordered), "median": 1000 * quantile(0.5), "p99": 1000 * quantile(0.99)}


def latencies(outcomes: list[Outcome]) -> dict[str, list[float]]:
    """The completed requests' latencies in seconds: time to first token, time per
    output token (of those with two or more), inter-token gaps (all of them), end to end."""
    done = [o for o in outcomes if o.error is None]
    return {"ttft": [o.ttft for o in done],
            "tpot": [(o.e2e - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1],
            "itl": [b - a for o in done for a, b in zip(o.chunks, o.chunks[1:])],
            "e2e": [o.e2e for o in done]}


def summarize(spec: LoadSpec, completions: str, model: str, outcomes: list[Outcome], seconds: float) -> dict:
    done = [o for o in outcomes if o.error is None]
    output = sum(o.output_tokens for o in done)
    failures = [o.error for o in outcomes if o.error is not None]
    return {"url": completions, "model": model, "requests": spec.requests, "rate": spec.rate,
            "concurrency": spec.concurrency, "max_tokens": spec.max_tokens, "completed": len(done),
            "failed": len(failures), "first_failure": failures[0] if failures else None,
            "duration_seconds": round(seconds, 4),
            "prompt_tokens": sum(o.prompt_tokens or 0 for o in done), "output_tokens": output,
            "requests_per_second": len(done) / seconds if seconds > 0 else 0.0,
            "output_tokens_per_second": output / seconds if seconds > 0 else 0.0,
            **{f"{key}_ms": _stats(values) for key, values in latencies(outcomes).items()}}


def print_report(report: dict) -> None:
    pace = (f"Poisson arrivals at {report['rate']:g}/s" if report["rate"] is not None else
            f"{report['concurrency']} in flight" if report["concurrency"] is not None else "all at once")
    print(f"{report['requests']} requests to {report['url']} (model {report['model']}, max_tokens "
          f"{report['max_tokens']}), {pace}: {report['completed']} completed, {report['failed']} failed, in "
          f"{report['duration_seconds']:.2f} s")
    print(f"  {report['requests_per_second']:.2f} requests/s, {report['output_tokens_per_second']:.1f} output "
          f"tokens/s ({report['output_tokens']} output tokens)")
    print(f"  {'ms':<18}{'mean':>10}{'median':>10}{'p99':>10}")
    names = {"ttft": "time to 1st token", "tpot": "time per token", "itl": "inter-token", "e2e": "end to end"}
    for key, name in names.items():
        stats = report[f"{key}_ms"]
        cells = "".join(f"{stats[k]:>10.1f}" for k in ("mean", "median", "p99")) if stats else f"{'-':>10}" * 3
        print(f"  {name:<18}{cells}")


def plot(outcomes: list[Outcome], report: dict, path: Path) -> None:
    """Histograms of the four latencies, written to `path` in the format its suffix names."""
    from specgraph.bench.report import plot_format
    from specgraph.files import write_output

    fmt = plot_format(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 6))
    names = {"ttft": "time to first token", "tpot": "time per output token", "itl": "inter-token latency",
             "e2e": "end-to-end latency"}
    for ax, (key, seconds) in zip(axes.flat, latencies(outcomes).items()):
        ax.hist([1000 * s for s in seconds], bins=30)
        ax.set_xlabel(f"{names[key]} (ms)")
        ax.set_ylabel("gaps" if key == "itl" else "requests")
    fig.suptitle(f"{report['model']}: {report['completed']} requests, {report['output_tokens_per_second']:.1f} output "
                 "tokens/s", fontsize=10)
    fig.tight_layout()
    write_output(path, lambda f: fig.savefig(f, dpi=110, format=fmt))
    plt.close(fig)


def run_loadgen(spec: LoadSpec, json_out: Path | None, plot_out: Path | None) -> dict:
    from tqdm import tqdm

    from specgraph.files import write_output

    completions, models = endpoints(spec.url)
    host = urlsplit(completions).hostname
    if not spec.allow_remote and not on_this_machine(host):
        raise SpecgraphError(f"URL: {host} is not this machine; loadgen sends load only here unless given "
                             "--allow-remote")
    model = asyncio.run(_model(spec, models))  # (before the bar: an error is a line of its own)
    with tqdm(total=spec.requests, desc="requests", unit="req", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        outcomes, seconds = asyncio.run(_drive(spec, completions, model, bar))
    report = summarize(spec, completions, model, outcomes, seconds)
    print_report(report)
    if json_out is not None:
        write_output(json_out, json.dumps(report | {"per_request": [asdict(o) for o in outcomes]}, indent=1))
    if plot_out is not None:
        plot(outcomes, report, plot_out)
    if report["failed"]:
        raise SpecgraphError(f"{report['failed']} of {spec.requests} requests failed (first: "
                             f"{report['first_failure']})")
    return report

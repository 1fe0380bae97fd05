"""What a Chrome trace of engine steps (scripts/profile_engine.py) says about the GPU's time:

  python3 scripts/trace_summary.py TRACE.json[.gz] STEPS

Over the span from the first to the last GPU kernel or copy: the time some kernel ran (intervals merged), the
idle rest, the idle gaps longer than 20 us, kernels per step, the ten costliest kernels by total time, and the
time of each class of kernel (projections, attention, norms, ...: `CLASSES`); and the host's mean `engine_step`
time. (Kernels launched dependently (kernels/pdl.py) start while the one before drains and wait inside: profile
with SPECGRAPH_PDL=0 for each kernel's own time.) Read on the CPU from a trace brought back from the GPU."""
import gzip
import json
import re
import shutil
import sys
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
CLASSES = (  # (class, kernel-name pattern): the first that matches names a kernel's class
    ("projection", r"gemv|_project|sum_splits|qlinear|nvjet|gemm|cutlass|sm90_xmma|splitK"),
    ("attention", r"attention|flash|_walk|gated_delta|_decode"),
    ("norm", r"rmsnorm|norm"),
    ("rope and cache write", r"rope"),
    ("sampling and acceptance", r"accept|gumbel|argmax|topk|sort|softmax|verdict"),
    ("copies", r"memcpy|memset|copy"),
)


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def summarize(path: str, steps: int) -> dict:
    events = load(path)
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e), key=lambda e: e["ts"])
    host_steps = [e["dur"] for e in events if e.get("name") == "engine_step" and e.get("cat") == "user_annotation"]
    busy, gaps, end = 0.0, [], None
    for e in gpu:  # merged intervals, in microseconds
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = (end - gpu[0]["ts"]) if gpu else 0.0
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    by_name = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:10]
    by_class = defaultdict(float)
    for name, (total, _) in by_name.items():
        by_class[next((c for c, pattern in CLASSES if re.search(pattern, name, re.I)), "other")] += total
    return {"steps": steps, "gpu_span_ms_per_step": span / steps / 1e3, "gpu_busy_ms_per_step": busy / steps / 1e3,
            "gpu_idle_ms_per_step": (span - busy) / steps / 1e3, "idle_gaps_over_20us_per_step":
            sum(g > 20 for g in gaps) / steps, "idle_in_gaps_over_20us_ms_per_step": sum(g for g in gaps if g > 20) / steps / 1e3,
            "kernels_per_step": len(kernels) / steps, "copies_per_step": sum(e["cat"] == "gpu_memcpy" for e in gpu) / steps,
            "host_step_ms": sum(host_steps) / len(host_steps) / 1e3 if host_steps else None,
            "ms_per_step_by_class": {c: total / steps / 1e3 for c, total in sorted(by_class.items(), key=lambda i: -i[1])},
            "top_kernels": [{"name": name, "ms_per_step": total / steps / 1e3, "calls_per_step": calls / steps}
                            for name, (total, calls) in top]}


def saved(profiler, out: Path, name: str, steps: int) -> dict:
    """`profiler`'s Chrome trace written as out/trace-NAME.json.gz -> its summary over `steps` steps."""
    out.mkdir(parents=True, exist_ok=True)
    raw = out / f"trace-{name}.json"
    profiler.export_chrome_trace(str(raw))
    with open(raw, "rb") as source, gzip.open(f"{raw}.gz", "wb", compresslevel=9) as sink:
        shutil.copyfileobj(source, sink)
    raw.unlink()
    return summarize(f"{raw}.gz", steps)


def print_top_kernels(summary: dict, step: str = "step") -> None:
    """The summary's costliest kernels, a line each (times per `step`: what its steps were)."""
    for row in summary["top_kernels"]:
        print(f"   {row['ms_per_step']:8.3f} ms/{step}  {row['calls_per_step']:6.1f}x  {row['name'][:110]}", flush=True)


if __name__ == "__main__":
    summary = summarize(sys.argv[1], int(sys.argv[2]))
    print(json.dumps(summary, indent=1))

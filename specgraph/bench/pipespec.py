"""A pipeline's statistics per stage, and PipeSpec's analytic steady-state throughput beside them.

PipeSpec (the review in ../shared/papers/001_*.txt, Eq. 3-4): with per-token acceptance rate
alpha between the last two stages and a window of gamma tokens, the last stage verifies a window
at a given step with the steady-state probability rho = alpha / (1 - alpha^(gamma + 1) + alpha)
and commits on average E = (1 - rho) + rho (1 - alpha^(gamma + 1)) / (1 - alpha) tokens per step;
tokens/s = E / (the last stage's step time). alpha is estimated from the measured counts as
accepted / (accepted + rejections) (each step ends at its first rejection, or takes its window).
"""

from __future__ import annotations


def steady_state(alpha: float, gamma: int) -> tuple[float, float]:
    """(rho, expected tokens per step of the last stage) for acceptance rate `alpha`, window `gamma`."""
    if alpha >= 1:
        return 1.0, gamma + 1.0
    tail = alpha ** (gamma + 1)
    rho = alpha / (1 - tail + alpha)
    return rho, (1 - rho) + rho * (1 - tail) / (1 - alpha)


def stage_table(stats: dict[str, float]) -> dict | None:
    """`<stage>.<count>` statistics summed over requests (runtime/pipeline.py's StageCounts) ->
    {"stages": {name: counts and rates, first stage first}, "analytic": PipeSpec's model}; None
    where the statistics are not a pipeline's."""
    names = sorted({key.rsplit(".", 1)[0] for key in stats if key.endswith(".window")},
                   key=lambda name: stats[f"{name}.index"])
    if not names:
        return None
    stages = {}
    for name in names:
        counts = {key.rsplit(".", 1)[1]: value for key, value in stats.items() if key.rsplit(".", 1)[0] == name}
        busy = counts["step_seconds"] + counts["idle_seconds"]
        tried = counts["accepted"] + counts["rejections"]
        stages[name] = {
            "steps": int(counts["steps"]), "step_ms": 1e3 * counts["step_seconds"] / counts["steps"] if counts["steps"] else None,
            "idle_share": counts["idle_seconds"] / busy if busy else None, "proposed": int(counts["proposed"]),
            "verified": int(counts["verified"]), "accepted": int(counts["accepted"]),
            "acceptance_rate": counts["accepted"] / tried if tried else None,
            "rolled_back": int(counts["rolled_back"]), "dropped": int(counts["dropped"]),
            "window": round(counts["window"] / counts["requests"]),
        }
    last = stages[names[-1]]
    analytic = None
    if last["acceptance_rate"] is not None and last["step_ms"]:
        rho, per_step = steady_state(last["acceptance_rate"], last["window"])
        analytic = {"alpha": last["acceptance_rate"], "window": last["window"], "rho": rho,
                    "tokens_per_step": per_step, "tokens_per_second": per_step / (last["step_ms"] / 1e3)}
    return {"stages": stages, "analytic": analytic}

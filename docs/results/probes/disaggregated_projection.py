"""Acceptance and re-root survival of the disaggregated executor, measured on the CPU (the
fixtures in fp32 compute the same function as their widened GPU shapes, so accepted lengths and
survival are the GPU's), with the step time each round would take on an H200 by the costs
measured in runs 35-37 (docs/benchmarks.md): a round takes max(V, G * E(B)) + s, plus f * E(B)
when the bonus token is not in the tree (a fresh tree's f forwards on the critical path).
A projection, not a measurement: it says which settings to measure next.

    python3 docs/results/probes/disaggregated_projection.py --drafter draft --prompts 16 \
        --grow '{steps: 4, leaves: 16, first: 5}' ...
"""

import argparse
import json
from pathlib import Path

from specgraph.program import Program
from specgraph.recipe import Recipe

REPO = Path(__file__).resolve().parents[3]
# H200, Llama-3-8B-shape target verifying 25 nodes; drafter forwards by leaves fed (runs 35-37)
COSTS = {"draft": {"verify": 5.41, "overhead": 0.65, "forward": lambda b: 1.20 + (b - 4) * 0.0183},
         "mid": {"verify": 5.42, "overhead": 0.65, "forward": lambda b: 2.60 + (b - 4) * 0.033}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafter", default="draft", choices=list(COSTS))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--grow", action="append", required=True, help="a grow spec, e.g. '{steps: 4, leaves: 16}'")
    parser.add_argument("--tree", default="{shape: dynamic, width: 4, depth: 5, nodes: 24}")
    args = parser.parse_args()
    rows = [json.loads(line) for line in (REPO.parent / "shared/fixtures/prompts_code.jsonl").open()][: args.prompts]
    draft = "models/draft" if args.drafter == "draft" else str(REPO.parent / "shared/fixtures/models/mid")
    cost = COSTS[args.drafter]
    for grow in args.grow:
        recipe = Recipe.from_yaml(REPO / "recipes/disaggregated.yaml", [f"models.draft.path={draft}", f"stages.0.grow={grow}", f"stages.0.tree={args.tree}",
                                                                        f"max_new_tokens={args.new_tokens}"])
        with Program.from_recipe(recipe) as program:
            plan = program.graph.node("draft")["tree"]
            forward = cost["forward"](plan.leaves)
            accepted = rounds = survived = ungrown = 0
            for row in rows:
                generation = program.generate(program.encode(row["prompt"]))
                accepted += sum(generation.accepted_lengths)
                rounds += generation.stats["rounds"]
                survived += generation.stats["survived"]
                ungrown += generation.stats["bonus_not_grown"]
        milliseconds = rounds * (max(cost["verify"], plan.grow * forward) + cost["overhead"]) \
            + (rounds - survived) * plan.first * forward
        print(f"tree {args.tree}, grow {grow}: accepted {accepted / rounds:.2f}, survived {survived / rounds:.0%}, bonus a node but "
              f"not grown {ungrown / rounds:.0%}, "
              f"projected {1e3 * accepted / milliseconds:.0f} tokens/s on an H200", flush=True)


if __name__ == "__main__":
    main()

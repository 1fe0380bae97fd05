"""The speculation policy (specgraph/engine/policy.py): each step runs plain decoding or speculation
at one of the drafter's tree depths, whichever is expected to give the batch the most tokens per
second. Step times come from a clock that charges each forward a price (a CPU's measured times vary
too much under load to test a choice on), so what the policy should choose follows by hand; the
tokens are transformers' greedy ones whatever it chooses, and sampling keeps the target's law."""

import pytest
import torch
from conftest import EMBEDDED
from helpers import (BUDGETS, Cycling, Ledger, decode_requests, decode_together, law, seeded_generations,
                     total_variation, two_stage, two_token_law)

from specgraph.engine import runner as runner_module
from specgraph.engine.policy import Acceptance, Policy, StepCosts, expected_tokens
from specgraph.engine.runner import PLAIN, Mode
from specgraph.engine.request import DECODE, PREFILL
from specgraph.passes import plan
from specgraph.program import Program
from specgraph.runtime.stage import Stage

DYNAMIC = {"shape": "dynamic", "width": 3, "depth": 4, "nodes": 10}


@pytest.fixture
def priced(monkeypatch):
    """A program whose steps are timed by a Ledger of the given prices (calibration included)."""

    def build(prices: dict[str, tuple[float, float]], **fields) -> Program:
        ledger = Ledger(prices)
        monkeypatch.setattr(Stage, "forward", ledger.charged(Stage.forward))
        monkeypatch.setattr(Stage, "feed", ledger.charged(Stage.feed))  # (prompt forwards, a drafter's catching up)
        monkeypatch.setattr(runner_module, "Clock", ledger.clock)
        return Program.from_recipe(two_stage(EMBEDDED / "target", EMBEDDED / "draft", DYNAMIC, **fields))

    return build


def expected(reference, budgets=BUDGETS):
    return [new[:budget] for (_, new), budget in zip(reference, budgets)]


def test_a_draft_that_costs_more_than_it_gains_is_never_run(priced, target_reference):
    """A drafter forward at 1 s, a target forward at 10 ms: a step of depth d costs at least 1 s for
    at most d + 1 tokens a request, plain decoding 10 ms for one. Even all drafts accepted could not
    pay, so no step speculates, not even a probe; the tokens are transformers'."""
    program = priced({"draft": (1.0, 0.0), "target": (0.010, 0.0)},
                     serving={"max_batch": 5, "block_size": 16, "speculation": "adaptive"})
    engine = program.executor
    # depth 1's step took ~2 s of drafts (catch-up, one level): timing depth 2 would take ~(4 + 0.01) s x 4 runs x 4
    # sizes = 64 s, more than calibrate.TIMING_BUDGET, so it and depth 4 are not timed and not among the policy's modes
    assert [mode.name for mode in engine.policy.modes] == ["ar", "depth 1"]
    assert decode_together(program, target_reference) == expected(target_reference)
    assert set(engine.totals.modes) == {"ar"} and engine.totals.modes["ar"] == engine.totals.steps > 30


def test_a_draft_that_pays_is_run(priced, target_reference):
    """A drafter forward at 0.1 ms, a target forward at 10 ms (plus 0.1 ms a token): speculation costs
    about what a plain step does and gives more tokens (the fixture drafter is often right), so the
    policy speculates, deepest tree included; the tokens are transformers'. What it expected of its
    most run mode is what that mode gave (ledger time, steps from one collection to the next), within
    a factor 1.5 either way (the acceptance it expects is an estimate)."""
    program = priced({"draft": (1e-4, 0.0), "target": (0.010, 1e-4)},
                     serving={"max_batch": 5, "block_size": 16, "speculation": "adaptive"})
    engine = program.executor
    assert decode_together(program, target_reference) == expected(target_reference)
    modes = engine.totals.modes
    assert modes.get("ar", 0) < 0.1 * engine.totals.steps and modes.get("depth 4", 0) > 0
    rates = engine.totals.rates()
    most = max(rates, key=lambda mode: rates[mode]["steps"])
    assert set(rates) <= set(modes) and 1 / 1.5 < rates[most]["realised"] / rates[most]["expected"] < 1.5, rates


def test_switching_modes_mid_request_keeps_the_greedy_tokens(target_reference):
    """Plain decoding, then depth 4, 2 and 1 trees in turn, requests five at a time with staggered
    finishes: a drafter that skipped steps is fed what it missed; every request gets transformers' tokens."""
    program = Program.from_recipe(two_stage(EMBEDDED / "target", EMBEDDED / "draft", DYNAMIC,
                                            serving={"max_batch": 5, "block_size": 16, "speculation": "adaptive"}))
    engine = program.executor
    engine.policy = Cycling(engine.runner.modes)
    assert decode_together(program, target_reference) == expected(target_reference)
    assert set(engine.totals.modes) == {"ar", "depth 4", "depth 2", "depth 1"}


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_an_eagle_head_switching_modes_mid_request_keeps_the_greedy_tokens(target_reference, batch, monkeypatch):
    """The shipped EAGLE-3 head under the policy: its modes are plain decoding, its dynamic tree cut
    to depths 3 and 1, and chains of 3 and 1, each after a run of 1 to 9 plain steps (which append
    their pairs, and feed the head those not fed once the 6 columns of a catch-up are full: after
    6 in a row), so requests go through every mode at every lag; every request gets transformers'
    tokens at batch 1, 4 and 16 (staggered finishes), and few plain steps feed the head (5 in the
    33 of a cycle at batch 1)."""
    from specgraph.head import HeadDrafter

    recipe = two_stage(EMBEDDED / "target", EMBEDDED / "eagle3", {"shape": "dynamic", "width": 4, "depth": 5, "nodes": 24},
                       serving={"max_batch": batch, "block_size": 16, "speculation": "adaptive"})
    program = Program.from_recipe(recipe)
    engine = program.executor
    assert [m.name for m in engine.runner.modes] == ["ar", "depth 5", "depth 3", "depth 1", "chain 3", "chain 1"]
    engine.policy = Cycling(engine.runner.modes, [0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 4,
                                                  0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    feeds = []
    fed = HeadDrafter.feed
    monkeypatch.setattr(HeadDrafter, "feed", lambda self, *args: feeds.append(1) or fed(self, *args))
    # (at batch 16 each request outlasts the 8 steps that feed all 16 prompts, so that the batch is full at times)
    budgets = {1: BUDGETS[:2], 4: BUDGETS[:8], 16: [24 + b % 24 for b in BUDGETS + [8, 40, 16, 32]]}[batch]
    reference = target_reference[: len(budgets)]
    assert decode_together(program, reference, budgets) == expected(reference, budgets)
    assert set(engine.totals.modes) == {m.name for m in engine.runner.modes}
    assert engine.totals.requests < sum(budgets)  # (drafts were accepted after every lag: fewer request-steps than tokens)
    assert 0 < len(feeds) <= engine.totals.modes["ar"] / 3  # (a newcomer's bound may call a feed sooner)


def test_switching_modes_mid_request_keeps_the_sampled_law():
    """Two sampled tokens after a prompt over many seeds, decoded 16 at a time (each request's draws
    are its own stream's), modes in turn (so a request's steps run plain then speculative, or the
    reverse): their law approaches the target's exact one, far below the draft's own distance to it
    (temperature 1, top-k 3: 9 outcomes)."""
    sampling, draws = {"temperature": 1.0, "top_k": 3}, 1200
    program = Program.from_recipe(two_stage(EMBEDDED / "target", EMBEDDED / "draft",
                                            {"shape": "static", "branching": [2, 2]}, sampling=sampling,
                                            max_new_tokens=2, serving={"speculation": "always", "max_batch": 16}))
    engine = program.executor
    engine.policy = Cycling([PLAIN, *engine.runner.modes[1:]])
    ids = program.encode("import os\nimport sys\n\n\ndef main(")
    observed = law(g.output_ids for g in seeded_generations(program, ids, draws))
    exact, draft = two_token_law(EMBEDDED / "target", ids, sampling), two_token_law(EMBEDDED / "draft", ids, sampling)
    assert set(observed) <= set(exact)
    assert total_variation(draft, exact) > 0.25  # the draft's own law is far from the target's
    assert total_variation(observed, exact) < 0.06  # (the expected distance at 1200 draws is about 0.03)
    assert engine.totals.modes["ar"] > 30 and engine.totals.modes["depth 2"] > 30  # (a step decodes 16 requests)


def test_acceptance_counts_each_depth_a_step_reached():
    """By hand: a depth-3 step that accepted 1 draft tried depths 1 and 2 and passed depth 1; one that
    accepted all 3 passed each; a depth-1 step that accepted its draft says nothing of depth 2."""
    counts = Acceptance(3)
    counts.observe(1, 3, "tree")
    counts.observe(3, 3, "tree")
    counts.observe(1, 1, "tree")
    assert counts.trials == {"tree": [0, 3, 2, 1]} and counts.hits == {"tree": [0, 3, 1, 1]}
    assert counts.rates([0.5] * 3, 0.0, "tree") == [1.0, 0.5, 1.0]
    assert counts.rates([0.5] * 3, 2.0, "tree") == [(3 + 1) / 5, (1 + 1) / 4, (1 + 1) / 3]
    # one prior number: depth 1's; each deeper depth is drawn toward the rate found above it
    assert counts.rates(0.5, 2.0, "tree") == pytest.approx([0.8, (1 + 2 * 0.8) / 4, (1 + 2 * 0.65) / 3])
    # shapes apart: a chain's counts leave a tree's rates, and all shapes' count together where none is named
    counts.observe(0, 3, "chain")
    assert counts.rates(0.5, 2.0, "tree") == pytest.approx([0.8, (1 + 2 * 0.8) / 4, (1 + 2 * 0.65) / 3])
    assert counts.rates([0.5] * 3, 2.0, "chain")[0] == pytest.approx(1 / 3) and counts.rates([0.5] * 3, 2.0, "plain") == [0.5] * 3
    assert counts.rates([0.5] * 3, 0.0) == [3 / 4, 0.5, 1.0]
    assert expected_tokens([0.5, 0.5, 0.5], 2) == 1 + 0.5 + 0.25 and expected_tokens([0.5], 0) == 1


def test_a_policy_that_ran_only_shallow_trees_moves_to_deeper_ones_that_pay():
    """Run 109 (one H100, the Llama-3-8B shape), batch 1: a step of ar, depth 1, 3 and 5 costs 5.77,
    8.16, 11.38 and 14.76 ms. A priori (every depth's rate 0.5) depth 1 runs: 1.5 tokens / 8.16 ms
    against ar's 1 / 5.77 ms and depth 3's 1.875 / 11.38 ms. A drafter that gets each depth right 8
    times in 10 gives, by hand, depth 3 2.952 tokens / 11.38 ms = 259 tokens/s and depth 5 3.689 /
    14.76 ms = 250 (within the 5% hysteresis of each other), depth 1 1.8 / 8.16 ms = 221: having seen
    only depth 1, the policy must move deeper. (Unseen depths guessed at a fixed 0.5 kept run 109 at
    depth 1 for 4,314 of its 4,760 steps.)"""
    import random

    class Tree:
        def __init__(self, depth):
            self.max_depth, self.nodes = depth, 4 * depth

    modes = [PLAIN, *(Mode(f"depth {d}", Tree(d)) for d in (5, 3, 1))]
    costs = StepCosts({"ar": {1: 5.77e-3}, "depth 5": {1: 14.76e-3}, "depth 3": {1: 11.38e-3}, "depth 1": {1: 8.16e-3}})
    policy = Policy(modes, costs, timed=False)
    assert policy.current.name == "depth 1"
    draws, request, chosen = random.Random(0), Acceptance(5), []
    for _ in range(400):
        mode = policy.choose([request])
        accepted = next((k for k in range(mode.depth) if draws.random() >= 0.8), mode.depth)
        policy.observe(mode, [accepted + 1], [request], 1, 0.0)
        chosen.append(mode.name)
    assert chosen[-1] in ("depth 3", "depth 5") and chosen.count("depth 1") < 40, chosen


def test_chains_and_trees_are_priced_by_their_own_rates():
    """Run 113 (one H100, the EAGLE-3 head, batch 1) settled on chain 3 for 3,832 steps: the chains'
    acceptance priced the trees too. By hand, at costs near its own: a head whose chain gets each depth
    right 55 times in 100 and whose trees (four children a node) 80: chain 3 gives 2.02 tokens / 7.5 ms
    = 269 tokens/s, a tree at depth 5 3.69 / 9.34 ms = 395 and at depth 3 2.95 / 8.3 ms = 356; priced
    at the chain's rates, depth 5 would give 2.16 / 9.34 ms = 231. From chain 3, the policy must probe
    the trees, find their own rates and move to them."""
    import random

    class Tree:
        def __init__(self, depth, nodes):
            self.max_depth, self.nodes = depth, nodes

    modes = [PLAIN, *(Mode(f"depth {d}", Tree(d, 4 * d)) for d in (5, 3, 1)),
             *(Mode(f"chain {d}", Tree(d, d)) for d in (3, 1))]
    assert [m.shape for m in modes] == ["plain", "tree", "tree", "tree", "chain", "chain"]
    costs = StepCosts({"ar": {1: 5.6e-3}, "depth 5": {1: 9.34e-3}, "depth 3": {1: 8.3e-3}, "depth 1": {1: 7.0e-3},
                       "chain 3": {1: 7.5e-3}, "chain 1": {1: 6.6e-3}})
    policy = Policy(modes, costs, timed=False)
    policy.current = modes[4]
    draws, request, chosen = random.Random(0), Acceptance(5), []
    for _ in range(1000):
        mode = policy.choose([request])
        right = 0.8 if mode.shape == "tree" else 0.55
        accepted = next((k for k in range(mode.depth) if draws.random() >= right), mode.depth)
        policy.observe(mode, [accepted + 1], [request], 1, 0.0)
        chosen.append(mode.name)
    assert chosen[0] == "chain 3" and chosen[-300:].count("depth 5") > 280, chosen
    assert sum(name.startswith("chain") for name in chosen[-300:]) < 10  # (the chains' probes, ever rarer)


def test_a_steps_first_runs_and_its_capture_leave_the_costs(monkeypatch):
    """A shape's first run (eager, compiling) and the run that captures it cost far more than its
    replays: Replays says a key is ready only once it replays (or where nothing is captured), and a
    step timed before that (seconds None) leaves the policy's costs; its acceptance still counts."""

    from specgraph.runtime import graphs

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build has no CUDA)
    recorded = []
    monkeypatch.setattr(graphs.CapturedGraph, "record",
                        classmethod(lambda cls, fn, inputs, pool: (recorded.append(fn) or fn, fn(*inputs))))
    replays = graphs.Replays(captured=True, after=2)
    readiness = []
    for _ in range(3):
        readiness.append(replays.ready("step"))
        replays.run("step", lambda: None)
    assert readiness == [False, False, True] and len(recorded) == 1
    assert graphs.Replays(captured=False).ready("step")

    class Tree:
        max_depth, nodes = 1, 3

    deep, request = Mode("depth 1", Tree()), Acceptance(1)
    policy = Policy([PLAIN, deep], StepCosts({"ar": {1: 0.010}, "depth 1": {1: 0.018}}))
    policy.observe(deep, [2], [request], 1, None)
    assert policy.costs.seconds("depth 1", 1) == 0.018 and request.hits["tree"][1] == 1


def test_a_step_is_charged_what_it_cost_the_engine(priced, target_reference):
    """Plain and depth-1 steps in turn, one request at a time (a drafter forward at 0.5 s, a target
    forward at 10 ms, by the ledger): each depth-1 step first feeds the drafter the token the plain
    step before left it (a forward), so it costs the engine ~1 s from one collection to the next
    (that feed 0.5, the catch-up 0.5, the verification 0.01), twice what its phases cost when the
    engine started (0.51 s). The policy's cost of depth 1 moves to what the engine lived; ar's stays."""
    import itertools

    program = priced({"draft": (0.5, 0.0), "target": (0.010, 0.0)},
                     serving={"max_batch": 1, "block_size": 16, "speculation": "adaptive"})
    engine = program.executor
    policy = engine.policy
    plain, shallow = policy.modes[0], policy.modes[-1]
    measured = policy.costs.seconds(shallow.name, 1)
    turns = itertools.cycle([plain, shallow])
    policy.choose = lambda acceptances, rows=None: next(turns)
    decode_requests(engine, [{"prompt": ids, "new": 40} for ids, _ in target_reference[:1]])
    assert shallow.name == "depth 1" and 0.5 < measured < 0.6
    assert policy.costs.seconds(shallow.name, 1) > 0.9 and policy.costs.seconds("ar", 1) < 0.02


def test_a_prompt_fed_beside_the_steps_is_charged_to_no_mode(priced, target_reference):
    """Newcomers join while others decode (four requests, two at a time); by the ledger a plain step
    of two rows costs 12 ms, a prompt forward of a newcomer's 255 tokens 265 ms. On a CPU the prompt
    forward runs before the engine collects the step in flight, but it is that step's cost no more
    than the next one's: ar's cost stays what its own forwards cost."""
    program = priced({"draft": (1.0, 0.0), "target": (0.010, 1e-3)},
                     serving={"max_batch": 2, "block_size": 16, "speculation": "adaptive"})
    engine, charged = program.executor, []
    decode_requests(engine, [{"prompt": ids, "new": 16} for ids, _ in target_reference[:4]],
                    lambda handles: charged.append(max(engine.policy.costs.seconds("ar", c) for c in (1, 2))))
    assert set(engine.totals.modes) == {"ar"} and 0.005 < min(charged) and max(charged) < 0.02, charged


def test_a_mode_not_running_drifts_back_to_its_measured_cost():
    """A lone stall (a step of 100 ms against ar's 10) moves a cost by a tenth; a stall lasting ten
    steps of depth 1 (100 ms against its measured 20) fades while only ar runs: DRIFT of the way back
    at each step of its size, so after 150 steps within a tenth of the stall's excess."""
    costs = StepCosts({"ar": {1: 0.010}, "depth 1": {1: 0.020}})
    costs.observe("ar", 1, 0.100)
    assert costs.seconds("ar", 1) == pytest.approx(0.011)
    for _ in range(10):
        costs.observe("depth 1", 1, 0.100)
    stalled = costs.seconds("depth 1", 1)
    for _ in range(150):
        costs.observe("ar", 1, 0.010)
    assert stalled > 0.03 and costs.seconds("depth 1", 1) - 0.020 < 0.1 * (stalled - 0.020)
    assert costs.seconds("ar", 1) == pytest.approx(0.010)
    costs.observe("ar", 2, 0.015)  # (a size a mode was not measured at leaves it alone)
    assert "depth 1" in costs.table and 2 not in costs.table["depth 1"]


def test_step_costs_between_and_past_the_measured_sizes():
    """By hand: 10 ms at 1, 14 ms at 2, 22 ms at 4 -> 18 ms at 3 (between 2 and 4), 26 ms at 5 (the line
    through 2 and 4 is 4 ms a request); a mode measured at one size only grows with the batch, and is that
    size's below it. A step's own time is taken where its size was not measured, then averaged in."""
    costs = StepCosts({"m": {1: 0.010, 2: 0.014, 4: 0.022}, "one": {2: 0.010}})
    assert [round(costs.seconds("m", n), 6) for n in (1, 3, 5)] == [0.010, 0.018, 0.026]
    assert costs.seconds("one", 4) == pytest.approx(0.020) and costs.seconds("one", 1) == 0.010
    costs.observe("m", 3, 0.028)
    assert costs.seconds("m", 3) == 0.028
    costs.observe("m", 3, 0.018)
    assert costs.seconds("m", 3) == pytest.approx(0.8 * 0.028 + 0.2 * 0.018)


def test_a_mode_replaces_the_current_one_only_for_a_clear_gain():
    """Plain at 10 ms a token; a depth-1 tree at 19.5 ms: with its draft accepted 1000 times in 1000 it
    gives (almost) 2 tokens, 2 / 19.5 ms = 102.6 tokens/s against 100, under the 5% a switch needs; at
    18 ms, 111 tokens/s: it switches."""

    class Tree:
        max_depth, nodes = 1, 3

    deep = Mode("depth 1", Tree())
    sure = Acceptance(1)
    for _ in range(1000):
        sure.observe(1, 1, "tree")
    policy = Policy([PLAIN, deep], StepCosts({"ar": {1: 0.010}, "depth 1": {1: 0.0195}}))
    policy.current = PLAIN
    policy.batchwide = sure
    assert policy.choose([sure]) is PLAIN
    policy.costs.table["depth 1"][1] = 0.018
    assert policy.choose([sure]) is deep


def test_plain_decoding_replaces_speculation_for_any_gain():
    """Depth 1 at 19.5 ms accepting (almost) always: 102.6 tokens/s against plain's 100; at 20.5 ms, 97.6:
    plain decoding takes over though its gain is under the 5% speculation needs (run 113 kept depth 1 at
    batch 32 below `ar`), and speculation comes back only for 5% (at 19.2 ms, 104: not; at 18 ms, 111: it does)."""

    class Tree:
        max_depth, nodes = 1, 3

    deep, sure = Mode("depth 1", Tree()), Acceptance(1)
    for _ in range(1000):
        sure.observe(1, 1, "tree")
    policy = Policy([PLAIN, deep], StepCosts({"ar": {1: 0.010}, "depth 1": {1: 0.0195}}))
    policy.current, policy.batchwide = deep, sure
    assert policy.choose([sure]) is deep
    chosen = []
    for seconds in (0.0205, 0.0192, 0.018):
        policy.costs.table["depth 1"][1] = seconds
        chosen.append(policy.choose([sure]).name)
    assert chosen == ["ar", "ar", "depth 1"]


def test_the_drafters_prompt_forwards_are_charged_to_speculation():
    """By hand: plain at 10 ms a token; depth 1 at 15 ms giving (almost) 2 tokens, 133 tokens/s. A
    drafter that costs 1.5 ms a prompt token, for a request of 2 prompt tokens per token it may get,
    adds 3 ms to each token a speculative step gives: 2 / (15 + 6) ms = 95 tokens/s, so plain decoding
    runs; what the policy expects of a step it runs is the step's own rate (what the engine realises
    of it), and a speculative shape that could not pay even with every draft accepted is not probed."""

    class Tree:
        max_depth, nodes = 1, 3

    deep, costs = Mode("depth 1", Tree()), StepCosts({"ar": {1: 0.010}, "depth 1": {1: 0.015}})
    cheap, dear = Acceptance(1, feeds_per_token=2.0), Acceptance(1, feeds_per_token=2.0)
    for counts in (cheap, dear):
        for _ in range(1000):
            counts.observe(1, 1, "tree")
    free = Policy([PLAIN, deep], costs, prompt_token_seconds=0.0)
    free.batchwide = cheap
    assert free.choose([cheap]) is deep and free.expected == pytest.approx(2 / 0.015, rel=1e-3)
    charged = Policy([PLAIN, deep], costs, prompt_token_seconds=0.0015)
    charged.current, charged.batchwide = deep, dear
    assert charged.rate(deep, [dear]) == pytest.approx(2 / 0.021, rel=1e-3)
    assert [charged.choose([dear]).name for _ in range(2 * 1024)] == ["ar"] * 2048
    assert charged.expected == pytest.approx(100.0)


def test_speculation_pays_for_what_its_drafter_missed_while_decoding_plainly():
    """By hand: plain at 10 ms a token, depth 1 at 15 ms giving (almost) 2 tokens (133 tokens/s), a
    drafter at 0.1 ms a token. Requests whose drafter was fed their prompts (1 prompt token a token
    they may get) are charged 0.1 ms a token: 2 / 15.2 ms, speculation. Where plain steps left it
    300 tokens behind with 4 tokens to go, feeding them costs 7.5 ms a token: 2 / 30 ms, plain."""

    class Tree:
        max_depth, nodes = 1, 3

    deep, sure = Mode("depth 1", Tree()), Acceptance(1)
    for _ in range(1000):
        sure.observe(1, 1, "tree")
    policy = Policy([PLAIN, deep], StepCosts({"ar": {1: 0.010}, "depth 1": {1: 0.015}}), prompt_token_seconds=1e-4)
    policy.batchwide = sure
    sure.feeds_per_token = 1.0
    assert policy.choose([sure]) is deep and policy.rate(deep, [sure]) == pytest.approx(2 / 0.0152, rel=1e-3)
    sure.feeds_per_token = max(1.0, 300 / 4)
    assert policy.choose([sure]) is PLAIN


def test_a_drafter_whose_prompts_cost_more_than_it_saves_is_not_run(priced, target_reference):
    """By the ledger: a target forward at 50 ms whatever its rows, the drafter 2 ms a token. Speculation
    pays in the steps of one or two requests (a depth-4 step of one: ~80 ms for ~3 tokens against 50 ms
    for 1), but a request of 255 prompt tokens that may get 8 costs the drafter 64 ms a token it gets:
    calibrated, that charge keeps every step plain (not even a probe); the same engine with the charge
    set to nothing speculates. Both give the greedy tokens."""
    program = priced({"draft": (0.0, 2e-3), "target": (0.050, 0.0)},
                     serving={"max_batch": 5, "block_size": 16, "speculation": "adaptive"})
    engine = program.executor
    assert engine.policy.prompt_token_seconds == pytest.approx(2e-3)
    requests = [{"prompt": ids, "new": 8} for ids, _ in target_reference[:5]]
    tokens = [new[:8] for _, new in target_reference[:5]]
    assert [h.generation.output_ids for h in decode_requests(engine, requests)] == tokens
    assert set(engine.totals.modes) == {"ar"}, engine.totals.modes
    engine.policy.prompt_token_seconds = 0.0
    steps = dict(engine.totals.modes)
    assert [h.generation.output_ids for h in decode_requests(engine, requests)] == tokens
    assert sum(engine.totals.modes.values()) - sum(steps.values()) > engine.totals.modes["ar"] - steps["ar"], \
        engine.totals.modes


@pytest.mark.parametrize("chunk", [512, 16])
def test_newcomers_feed_the_drafter_only_where_speculation_pays_at_the_batch_they_join(chunk, priced, target_reference,
                                                                                      monkeypatch):
    """By the ledger: a target forward at 10 ms plus 1.5 ms a token, the drafter 0.1 ms a forward. A depth-1
    step (up to 4 tokens a request) expected to give 1.5 tokens (the policy's prior) pays for one request
    (1.5 x 11.5 ms > 10 + 4 x 1.5 + 0.1 ms) but not for five (1.5 x 17.5 ms < 10 + 20 x 1.5 ms). Five
    requests admitted at once: while all five are in the engine, their prompt forwards do not feed the
    drafter (run 126: at batch 64 that was 4% of the run for nothing), nor, where prompts go in 16 tokens a
    step, is it synced for the first request to decode while the rest go in (a step's mode is chosen for
    the batch it heads to); one request alone: its prompt forward feeds it. Tokens are transformers'."""
    program = priced({"draft": (1e-4, 0.0), "target": (0.010, 1.5e-3)},
                     serving={"max_batch": 5, "block_size": 16, "speculation": "adaptive", "prefill_chunk": chunk})
    engine, fed = program.executor, []
    feed = Stage.feed
    monkeypatch.setattr(Stage, "feed", lambda stage, tokens, layout: (
        fed.append(tokens.numel()) if stage.name == "draft" else None, feed(stage, tokens, layout))[1])
    assert engine.policy.pays_at(1, 0.0) and not engine.policy.pays_at(5, 0.0)
    requests = [{"prompt": ids, "new": 8} for ids, _ in target_reference[:5]]

    def fed_while_shared(handles):  # the drafter's tokens fed in steps that began with all five in the engine
        if held[-1] == len(requests):
            shared.append(sum(fed))
        held.append(sum(h.status in (PREFILL, DECODE) for h in handles))

    held, shared = [len(requests)], []
    handles = decode_requests(engine, requests, fed_while_shared)
    assert shared and max(shared) == 0, shared
    assert [h.generation.output_ids for h in handles] == [new[:8] for _, new in target_reference[:5]]
    fed.clear()
    alone = decode_requests(engine, requests[:1])
    assert sum(fed) >= len(requests[0]["prompt"]) - 3, fed  # (all but the last two, and the last: the first step's)
    assert alone[0].generation.output_ids == target_reference[0][1][:8]


def test_a_head_or_no_drafter_costs_prompts_nothing():
    """A head is fed the target's features by every prompt forward, whatever the mode; plain decoding
    has no drafter: neither adds anything to a prompt (calibrate.prompt_token_seconds)."""
    from specgraph.engine.calibrate import prompt_token_seconds

    class Runner:
        drafter, features = None, None

    assert prompt_token_seconds(Runner(), 64) == 0.0
    Runner.drafter, Runner.features = object(), object()
    assert prompt_token_seconds(Runner(), 64) == 0.0


def test_speculation_whose_budget_verifies_no_node_is_no_candidate():
    """By hand: a budget of 3 nodes for one request and none for two. A depth-1 step costing a thousandth
    of a plain one wins alone; with two requests it would verify nothing, so plain decoding runs."""
    from specgraph.engine.budget import Budget

    class Tree:
        max_depth, nodes = 1, 3

    policy = Policy([PLAIN, Mode("depth 1", Tree())], StepCosts({"ar": {1: 1.0}, "depth 1": {1: 0.001}}),
                    budget=Budget({1: 3, 2: 0}, per_request=3))
    assert policy.choose([Acceptance(1)]).name == "depth 1"
    assert policy.choose([Acceptance(1), Acceptance(1)]) is PLAIN


def test_an_untimed_policy_keeps_its_measured_costs():
    """Ranks that run one engine take the same decisions only on the same times: where `timed` is off,
    a step's own time (each rank's clock) leaves the costs as calibrated (agreed by every rank)."""
    class Tree:
        max_depth, nodes = 1, 3

    deep = Mode("depth 1", Tree())
    for timed, expected in ((True, 0.018 * 1.1), (False, 0.018)):  # (timed: up by at most STEP_CHANGE)
        policy = Policy([PLAIN, deep], StepCosts({"ar": {1: 0.010}, "depth 1": {1: 0.018}}), timed=timed)
        policy.observe(deep, [2], [Acceptance(1)], 1, 0.036)
        assert policy.costs.seconds("depth 1", 1) == pytest.approx(expected)


def test_a_second_build_of_the_same_engine_reuses_its_step_costs(tmp_path, monkeypatch, caplog):
    """The policy's step costs are saved beside the compiled code (engine/saved.py): a second build
    of the same program here times nothing and weighs the first one's costs; another shape (a larger
    batch) or other weights for the same recipe (its target quantized: runs 136's w8a16 and fp8 builds
    weighed run 133's w4a16 costs) are timed anew, and a file that cannot be read is timed again and
    rewritten."""
    import json

    from specgraph import lower
    from specgraph.models.loader import load_model
    from specgraph.models.widen import widen

    timed = []

    def step_costs(runner, modes, sizes, budget, context, agree):  # (stands for the timing: it counts)
        timed.append(sizes)
        return {mode.name: {size: 0.01 * (len(timed) + mode.depth) for size in sizes} for mode in modes}

    def build(models: dict | None = None, **serving) -> dict:
        recipe = two_stage(EMBEDDED / "target", EMBEDDED / "draft", DYNAMIC,
                           serving={"max_batch": 1, "speculation": "adaptive", **serving})
        with Program(plan(recipe), models) as program:
            return program.executor.policy.costs.table

    monkeypatch.setattr(lower, "step_costs", step_costs)
    monkeypatch.setenv("SPECGRAPH_TIMINGS", str(tmp_path))
    first = build()
    assert build() == first and len(timed) == 1 and first["depth 1"] == {1: 0.02}
    assert build(max_batch=2) != first and timed == [[1], [1, 2]]
    target = load_model(EMBEDDED / "target", torch.float32, "cpu")
    quantized = widen(target, target.shape, "cpu", torch.float32, quantize="w8a16")
    assert build({"target": quantized}) != first and timed == [[1], [1, 2], [1]]
    saved = sorted(tmp_path.glob("step-costs-*.json"))
    assert len(saved) == 3 and all(json.loads(path.read_text())["value"] for path in saved)
    for path in saved:
        path.write_text("{not json")
    with caplog.at_level("WARNING", "specgraph.build"):
        assert build() != first and len(timed) == 4
    assert "could not be read" in caplog.text and build() == build() and len(timed) == 4

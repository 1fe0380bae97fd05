"""The engine's bookkeeping: end-of-sequence, token budget, accepted lengths, many requests at once."""

import torch
from helpers import markov_engine

from specgraph.recipe import ChainTree
from specgraph.tree import CATCH_UP, TreeTopology


def cycle_table(v: int = 5) -> torch.Tensor:
    """Deterministic chain 1 -> 2 -> 3 -> 4 -> 0 -> 1 (token 0 plays end-of-sequence)."""
    table = torch.full((v, v), 1e-6)
    for t in range(v):
        table[t, (t + 1) % v] = 1.0
    return table / table.sum(-1, keepdim=True)


def executor(eos=(0,), draft_table=None, length=3, max_seq_len=64, plan=None, batch=1):
    return markov_engine(cycle_table(), cycle_table() if draft_table is None else draft_table,
                         plan or TreeTopology.from_spec(ChainTree(length=length)), eos=eos, max_seq_len=max_seq_len,
                         batch=batch)


def test_generation_stops_at_end_of_sequence_inclusive():
    gen = executor().generate([1], 50)
    assert gen.output_ids == [2, 3, 4, 0]
    assert gen.accepted_lengths == [4]  # three drafts accepted + the bonus, all in one step


def test_budget_is_exact_even_when_a_step_overshoots():
    gen = executor(eos=()).generate([1], 6)
    assert gen.output_ids == [2, 3, 4, 0, 1, 2] and gen.accepted_lengths == [4, 2]  # what each step emitted


def test_a_useless_draft_still_yields_the_target_tokens():
    wrong = torch.roll(cycle_table(), 2, dims=1)  # always guesses two ahead
    gen = executor(eos=(), draft_table=wrong).generate([1], 7)
    assert gen.output_ids == [2, 3, 4, 0, 1, 2, 3] and set(gen.accepted_lengths) == {1}


def test_generation_is_clipped_to_max_seq_len():
    gen = executor(eos=(), max_seq_len=10).generate([1, 2, 3], 100)
    assert len(gen.output_ids) == 7 and gen.clipped and sum(gen.accepted_lengths) == 7
    assert not executor(eos=(), max_seq_len=10).generate([1, 2, 3], 7).clipped


def test_an_end_of_sequence_at_the_last_room_is_a_stop_not_a_clip():
    """max_seq_len leaves room for exactly the tokens up to and including the end-of-sequence token."""
    gen = executor(max_seq_len=5).generate([1], 100)
    assert gen.output_ids == [2, 3, 4, 0] and gen.finish_reason == "stop" and not gen.clipped
    assert executor(eos=(), max_seq_len=5).generate([1], 100).finish_reason == "clipped"
    assert executor(eos=(), max_seq_len=5).generate([1], 4).finish_reason == "length"


def test_output_keeps_the_budget_and_the_first_end_of_sequence_token():
    """The one bookkeeping every executor's output goes through."""
    from specgraph.runtime.executor import Generation, Output

    gen = Generation(output_ids=[])
    output = Output(gen, prompt_tokens=3, max_new_tokens=10, max_seq_len=8, stops=(9,))  # room for 5
    assert output.budget == 5 and not output.take([1, 2]) and output.room == 3
    assert output.take([3, 9, 4]) and gen.output_ids == [1, 2, 3, 9] and gen.finish_reason == "stop"
    assert gen.accepted_lengths == [2, 2]
    gen = Generation(output_ids=[])
    output = Output(gen, prompt_tokens=3, max_new_tokens=10, max_seq_len=8, stops=(9,))
    assert output.take([1, 2, 3, 4, 5, 9]) and gen.output_ids == [1, 2, 3, 4, 5] and gen.clipped


def test_a_step_touches_only_device_tensors():
    """What a captured step needs: no host reads and no host values copied in, in either phase,
    for static and dynamic trees and the target alone."""
    from helpers import HostReads

    from specgraph.recipe import DynamicTree

    for plan in (TreeTopology.from_spec(ChainTree(length=3)), DynamicTree(width=2, depth=3, nodes=4)):
        engine = executor(eos=(), plan=plan, batch=2)
        runner = engine.runner
        for prompt in ([1, 2], [3]):
            engine.add_request(prompt, 8)
        engine.step()
        engine.step()  # both prompts in, a first step decoded
        rows = torch.tensor([0, 1])
        for mode in runner.modes:  # plain decoding, then the tree
            with HostReads() as reads:
                result = runner.step(rows, mode, 30, None)
            assert reads.seen == [] and result.shape == (2, mode.depth + 2)


def test_many_requests_at_once_end_each_where_it_ends_alone():
    """Requests of different prompts and budgets, four at a time, six in all: each request's output
    is the one it gets alone; the first four finish at different steps and the last two take their places."""
    half_wrong = torch.roll(cycle_table(), 1, dims=1) * 0.5 + cycle_table() * 0.5
    jobs = [([1], 40), ([2, 3], 3), ([4], 11), ([0, 1, 2], 7), ([3], 1), ([2], 20)]
    alone = [executor(eos=(0,), draft_table=half_wrong).generate(prompt, budget).output_ids for prompt, budget in jobs]
    engine = executor(eos=(0,), draft_table=half_wrong, batch=4)
    requests = [engine.add_request(prompt, budget) for prompt, budget in jobs]
    admitted = []
    while engine.busy:
        engine.step()
        admitted.append(sum(r.status != "waiting" for r in requests))
    assert [r.generation.output_ids for r in requests] == alone
    assert admitted[0] == 4 and admitted[-1] == 6  # the last two waited for places


def test_a_full_pool_makes_requests_wait_and_loses_none():
    """A pool that holds two requests' blocks: the third waits, then runs; every output is whole."""
    engine = markov_engine(cycle_table(), cycle_table(), TreeTopology.from_spec(ChainTree(length=3)), eos=(),
                           max_seq_len=64, batch=3, block_size=16, kv_blocks=1 + 2 * 4)  # 4 blocks each: 40 + 32 slots
    requests = [engine.add_request([1], 30) for _ in range(3)]
    running = []
    while engine.busy:
        engine.step()
        running.append(sum(r.status == "decode" for r in requests))
    assert max(running) == 2  # never three at once: the pool held two
    assert all(len(r.generation.output_ids) == 30 for r in requests)


def test_requests_decoded_together_keep_their_own_tokens_for_every_tree_shape():
    """Requests decoded together (their steps interleaved with each other's admission and
    prefill) give the tokens each gets alone, for static and dynamic trees (whose verdicts vary in
    length) and at an end-of-sequence token."""
    from specgraph.recipe import DynamicTree

    for plan in (TreeTopology.from_spec(ChainTree(length=3)), DynamicTree(width=2, depth=3, nodes=4)):
        half_wrong = torch.roll(cycle_table(), 1, dims=1) * 0.5 + cycle_table() * 0.5
        alone = [executor(eos=(0,), draft_table=half_wrong, plan=plan).generate(p, n).output_ids
                 for p, n in (([1], 40), ([2, 3], 3))]
        engine = executor(eos=(0,), draft_table=half_wrong, plan=plan, batch=2)
        requests = [engine.add_request(p, n) for p, n in (([1], 40), ([2, 3], 3))]
        while engine.busy:
            engine.step()
        assert [r.generation.output_ids for r in requests] == alone and alone[0][-1] == 0


def test_an_aborted_request_gives_its_place_to_the_next():
    engine = executor(eos=(), batch=1)
    first, second = engine.add_request([1], 50), engine.add_request([2], 5)
    engine.step()
    assert first.status == "decode" and second.status == "waiting"
    engine.abort(first.id)
    while engine.busy:
        engine.step()
    assert second.finished and len(second.generation.output_ids) == 5 and len(first.generation.output_ids) < 50


def test_the_budget_table_gives_each_batch_size_its_nodes():
    """By hand: calibrated shares per request 6, 4 and 3 at batch sizes 1, 2 and 4. A batch between two
    calibrated sizes takes the larger one's share (3 at 3: 9 nodes); past the largest, its share (3);
    each request at most its tree's 5 nodes (batch 1), or fewer where a mode's tree is smaller."""
    from specgraph.engine.budget import Budget, batch_sizes

    budget = Budget({1: 6, 2: 8, 4: 12}, per_request=5)
    assert [budget(c) for c in (1, 2, 3, 4, 6, 8)] == [5, 8, 9, 12, 18, 24]
    assert budget(2, per_request=2) == 4
    assert batch_sizes(12) == [1, 2, 4, 8, 12] and batch_sizes(1) == [1]


def test_a_request_never_gets_more_nodes_in_a_bigger_batch():
    """{1: 24, 4: 48} gave a batch of 3 72 nodes (24 each, the smaller size's share) and one of 4 48;
    a share that grows with the batch (8: 16 each, above 4's 12) is cut to the smaller batch's."""
    from specgraph.engine.budget import Budget

    budget = Budget({1: 24, 4: 48, 8: 128}, per_request=24)
    assert [budget(c) for c in range(1, 9)] == [24, 24, 36, 48, 60, 72, 84, 96]
    shares = [budget(c) / c for c in range(1, 65)]
    assert all(a >= b for a, b in zip(shares, shares[1:]))

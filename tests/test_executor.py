"""The serial executor's bookkeeping: end-of-sequence, token budget, accepted lengths."""

import torch
from helpers import MarkovModel

from specgraph.draft import Drafter
from specgraph.recipe import ChainTree, SamplingSpec, VerifySpec
from specgraph.runtime.serial import SerialExecutor
from specgraph.runtime.verifier import Verifier
from specgraph.runtime.stage import Stage
from specgraph.tree import TreeTopology

CPU = torch.device("cpu")


def cycle_table(v: int = 5) -> torch.Tensor:
    """Deterministic chain 1 -> 2 -> 3 -> 4 -> 0 -> 1 (token 0 plays end-of-sequence)."""
    table = torch.full((v, v), 1e-6)
    for t in range(v):
        table[t, (t + 1) % v] = 1.0
    return table / table.sum(-1, keepdim=True)


def executor(eos=(0,), draft_table=None, length=3, max_seq_len=64, plan=None):
    verifier = Verifier(Stage("t", MarkovModel(cycle_table()), max_seq_len + 8, CPU), VerifySpec(), "greedy", SamplingSpec())
    drafter = Drafter(Stage("d", MarkovModel(cycle_table() if draft_table is None else draft_table), max_seq_len + 8, CPU),
                      plan or TreeTopology.from_spec(ChainTree(length=length)), "greedy", SamplingSpec())
    return SerialExecutor(verifier, drafter, eos_ids=eos, max_seq_len=max_seq_len)


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
    output = Output(gen, prompt_tokens=3, max_new_tokens=10, max_seq_len=8, eos_ids=(9,))  # room for 5
    assert output.budget == 5 and not output.take([1, 2]) and output.room == 3
    assert output.take([3, 9, 4]) and gen.output_ids == [1, 2, 3, 9] and gen.finish_reason == "stop"
    assert gen.accepted_lengths == [2, 2]
    gen = Generation(output_ids=[])
    output = Output(gen, prompt_tokens=3, max_new_tokens=10, max_seq_len=8, eos_ids=(9,))
    assert output.take([1, 2, 3, 4, 5, 9]) and gen.output_ids == [1, 2, 3, 4, 5] and gen.clipped


def test_a_static_tree_step_touches_only_device_tensors():
    """What a captured step needs: no host reads and no host values copied in, in either phase."""
    from helpers import HostReads

    from specgraph.runtime.clock import Clock

    speculative = executor(eos=(), length=3)
    autoregressive = SerialExecutor(speculative.verifier, None, eos_ids=(), max_seq_len=64)
    for ex, depth in ((speculative, 3), (autoregressive, 0)):
        ex.generate([1, 2], 4)  # prefill and a first step
        length = int(ex.sequence.length)
        with HostReads() as reads:
            result = ex._step(length, (None, None), Clock(CPU))
        assert reads.seen == [] and result.shape == (depth + 2,)


def test_enqueueing_ahead_changes_no_token():
    """The GPU's lookahead (next step enqueued before this one is read), forced on here: same tokens,
    for static and dynamic trees (whose verdicts vary in length) and at an end-of-sequence token."""
    from specgraph.recipe import DynamicTree

    for plan in (TreeTopology.from_spec(ChainTree(length=3)), DynamicTree(width=2, depth=3, nodes=4)):
        half_wrong = torch.roll(cycle_table(), 1, dims=1) * 0.5 + cycle_table() * 0.5
        outputs = []
        for lookahead in (False, True):
            ex = executor(eos=(0,), draft_table=half_wrong, plan=plan)
            ex.lookahead = lookahead
            outputs.append([ex.generate([1], 40).output_ids, ex.generate([2, 3], 3).output_ids])
        assert outputs[0] == outputs[1] and outputs[0][0][-1] == 0

"""Tree-aware KV caches keep their invariant (cache.py) through random trees and random verdicts,
checked against recomputation from scratch: the committed prefix's K/V equal a prefill of the
committed tokens, and (the growing drafter) every fed node's K/V equal those of its whole path
run alone, its score the sum of its path's draft log-probabilities."""

import random

import torch
from conftest import EMBEDDED
from helpers import chain_logits

from specgraph.growing import EXPANDED, UNUSED, GrowingDrafter
from specgraph.layout import physical
from specgraph.models.loader import load_model
from specgraph.runtime.stage import Stage
from specgraph.sampling import SamplingRows
from specgraph.tree import Growth, Tree

CPU = torch.device("cpu")
ATOL = 1e-5


def kv_from_scratch(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [layers, Hkv, T, K] of `ids` [T] prefilled into a fresh cache."""
    stage = Stage("fresh", model, ids.numel() + 4, CPU)
    with torch.no_grad():
        stage.prefill(ids)
    slots = physical(stage.table, stage.block_size, 0, torch.arange(ids.numel()))
    return stage.cache.k[:, 0, :, slots], stage.cache.v[:, 0, :, slots]


def assert_rows(stage: Stage, virtual: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The K/V at virtual slots `virtual` of the stage's request (row 0) are k, v."""
    slots, cache = physical(stage.table, stage.block_size, 0, virtual), stage.cache
    assert torch.allclose(cache.k[:, 0, :, slots], k, atol=ATOL) and torch.allclose(cache.v[:, 0, :, slots], v, atol=ATOL)


def path_of(g: GrowingDrafter, node: int) -> list[int]:
    """Pool indices from the root to `node`."""
    path = [node]
    while path[-1] != 0:
        path.append(int(g.parents[path[-1]]))
    return path[::-1]


def check_growing_tree(g: GrowingDrafter, committed: list[int], rng: random.Random) -> None:
    model = g.stage.model
    length = len(committed)
    k, v = kv_from_scratch(model, torch.tensor(committed[:-1]))
    assert_rows(g.stage, torch.arange(length - 1), k, v)  # the committed prefix
    assert int(g.tokens[0]) == committed[-1] and int(g.fed[0]) == 0  # the root: last committed, at offset 0
    fed = [n for n in range(int(g.size)) if int(g.fed[n]) >= 0]
    offsets = [int(g.fed[n]) for n in fed]
    assert len(set(offsets)) == len(offsets) and max(offsets) < int(g.fed_count)  # (a pick past the leaves leaves a gap)
    assert all(int(g.fed[int(g.parents[n])]) < int(g.fed[n]) for n in fed if n > 0)  # feed order: ancestors first
    for node in rng.sample(fed, min(6, len(fed))):  # a fed node's K/V: those of its whole path run alone
        path = path_of(g, node)
        ids = torch.tensor(committed + [int(g.tokens[n]) for n in path[1:]])
        k, v = kv_from_scratch(model, ids)
        assert_rows(g.stage, torch.tensor([length - 1 + int(g.fed[node])]), k[:, :, -1:], v[:, :, -1:])
    for node in rng.sample(range(1, int(g.size)), min(4, int(g.size) - 1)):  # a node's score: its path's draft log-probability
        if int(g.status[node]) == UNUSED:
            continue
        path = path_of(g, node)
        ids = torch.tensor(committed + [int(g.tokens[n]) for n in path[1:]])
        log_probs = chain_logits(model, ids).log_softmax(-1)
        expected = sum(float(log_probs[length - 2 + d, ids[length - 1 + d]]) for d in range(1, len(path)))
        assert abs(float(g.scores[node]) - expected) < 1e-3


def check_selection(g: GrowingDrafter, tokens: torch.Tensor, parents: torch.Tensor) -> None:
    """The sent tree: the root and the N most likely eligible nodes, ancestor-closed, in pool order
    (then, where fewer qualify, repeats of the root's best child)."""
    sent = g.sent.tolist()
    eligible = [n for n in range(1, int(g.size)) if int(g.status[n]) != UNUSED and int(g.depths[n]) <= g.growth.depth]
    best = sorted(eligible, key=lambda n: (-float(g.scores[n]), n))[: g.growth.nodes]
    assert sent[0] == 0 and sent[1 : len(best) + 1] == sorted(best)
    assert sent[len(best) + 1 :] == best[:1] * (g.growth.nodes - len(best)) and int(g.parents[best[0]]) == 0
    for i, node in enumerate(sent[1:], start=1):
        assert int(tokens[i]) == int(g.tokens[node]) and sent[int(parents[i])] == int(g.parents[node])


def test_growing_tree_keeps_its_invariant_over_random_verdicts():
    torch.manual_seed(0)
    rng = random.Random(0)
    model = load_model(EMBEDDED / "draft", torch.float32, CPU)
    plan = Growth(width=3, depth=3, nodes=8, grow=2, leaves=4, first=3)
    stage = Stage("draft", model, 200 + plan.region, CPU)
    g = GrowingDrafter(stage, plan)
    committed = torch.randint(0, 4096, (12,)).tolist()
    buffer = torch.zeros(200, dtype=torch.long)
    buffer[: len(committed)] = torch.tensor(committed)
    width = stage.capacity  # forwards attend over every slot (the masks hide what they must not see)
    with torch.no_grad():
        stage.prefill(torch.tensor(committed[:-2]))
        g.restart(buffer, torch.tensor(len(committed)), width)
        survived = restarts = 0
        for _ in range(24):
            tokens, parents = g.select()
            check_selection(g, tokens, parents)
            length = torch.tensor(len(committed))
            for _ in range(plan.grow):
                g.expand(length, width)
            tree = Tree(tokens[None], parents[None])
            path = [0]
            while tree.children(path[-1]) and rng.random() < 0.75:  # a random accepted path
                path.append(rng.choice(tree.children(path[-1])))
            last = int(g.sent[path[-1]])
            kids = [n for n in range(int(g.size)) if int(g.parents[n]) == last and int(g.status[n]) != UNUSED]
            expanded = [n for n in kids if int(g.status[n]) == EXPANDED]
            if expanded and rng.random() < 0.6:  # a bonus the tree already holds ...
                bonus = int(g.tokens[rng.choice(expanded)])
            else:  # ... or one it does not
                bonus = rng.choice([t for t in range(4096) if t not in {int(g.tokens[n]) for n in kids}])
            new = [int(tokens[n]) for n in path[1:]] + [bonus]
            count = len(new)
            pad = plan.depth + 1 - count
            held = bonus in {int(g.tokens[n]) for n in expanded}
            among = bonus in {int(g.tokens[n]) for n in kids}
            kept, present = g.reroot(torch.tensor(path + [-1] * pad), torch.tensor(count), torch.tensor(new + [0] * pad),
                                     length)
            assert bool(kept) == held and bool(present) == among
            committed += new
            buffer[: len(committed)] = torch.tensor(committed)
            if kept:
                survived += 1
            else:
                restarts += 1
                g.restart(buffer, torch.tensor(len(committed)), width)
            check_growing_tree(g, committed, rng)
    assert survived >= 5 and restarts >= 5


def test_a_target_commit_keeps_the_prefix_of_every_random_tree_and_verdict():
    """KVCache.commit: after random trees and random accepted paths, the committed prefix's K/V
    equal a prefill of the committed tokens (the target's side of the invariant)."""
    torch.manual_seed(1)
    rng = random.Random(1)
    model = load_model(EMBEDDED / "target", torch.float32, CPU)
    stage = Stage("target", model, 160, CPU)
    committed = torch.randint(0, 4096, (10,)).tolist()
    with torch.no_grad():
        stage.prefill(torch.tensor(committed[:-1]))
        for _ in range(8):
            n = rng.randint(1, 9)
            parents = [-1] + [rng.randrange(i) for i in range(1, n + 1)]
            tree = Tree(torch.tensor([[committed[-1]] + torch.randint(0, 4096, (n,)).tolist()]), torch.tensor([parents]))
            root = len(committed) - 1
            stage.forward_one(tree.tokens[0], root + tree.depths[0], torch.tensor(root), torch.arange(tree.size),
                              tree.ancestors[0], 160)
            path = [0]
            while tree.children(path[-1]) and rng.random() < 0.7:
                path.append(rng.choice(tree.children(path[-1])))
            padded = path + [-1] * (tree.max_depth + 1 - len(path))
            stage.cache.commit(stage.table, torch.zeros(1, dtype=torch.long), torch.tensor([padded]), torch.tensor([root]))
            committed += [int(tree.tokens[0, i]) for i in path[1:]] + [rng.randrange(4096)]  # accepted drafts, a bonus
            k, v = kv_from_scratch(model, torch.tensor(committed[:-1]))
            assert_rows(stage, torch.arange(len(committed) - 1), k, v)


class QuietMailbox:
    """A pipeline stage's mailbox that sends nowhere (the test plays the stages beside it) and
    keeps the last message's payload."""

    capacity = 64

    def send(self, dst, header, tokens=()) -> None:
        self.last = list(tokens)

    def open(self, finals, is_final) -> None:
        pass


def pipeline_stage(index: int, tree: dict | None = None):
    """Stage `index` of a draft -> target -> target pipeline on the CPU, built as its process would
    (the first stage drafting chains of 3, or `tree`s)."""
    from specgraph.draft import Drafter
    from specgraph.lower import build_verifier, load_stage
    from specgraph.passes import plan
    from specgraph.recipe import Recipe
    from specgraph.runtime.pipeline import DraftingPeer, VerifyingPeer

    models = {"draft": {"path": str(EMBEDDED / "draft")}, "target": {"path": str(EMBEDDED / "target")}}
    stages = [{"name": "s0", "model": "draft", "devices": ["cpu"], "tree": tree or {"shape": "chain", "length": 3}},
              {"name": "s1", "model": "target", "devices": ["cpu"], "verifies": "s0",
               "verify": {"window": 4} if tree is None else {}},
              {"name": "s2", "model": "target", "devices": ["cpu"], "verifies": "s1"}]
    graph = plan(Recipe.from_dict({"name": "p", "models": models, "stages": stages, "execution": "pipeline",
                                   "max_seq_len": 96}))
    name = f"s{index}"
    node = graph.node(name)
    common = dict(names=["s0", "s1", "s2"], index=index, leaders=[2, 1, 0], mailbox=QuietMailbox(), window=node["window"] or 0,
                  ahead=node["ahead"], synchronous=False, device=CPU, max_seq_len=96, eos_ids=(),
                  sampling=SamplingRows.of([graph.recipe.sampling], CPU))
    stage = load_stage(graph, name)
    if index == 0:
        drafter = Drafter(stage, node["tree"], "greedy", node["feeds"])
        return DraftingPeer(drafter, tree is not None, node["cache_slots"], **common)
    return VerifyingPeer(build_verifier(graph, {name: stage}, name), False, **common)


def check_rolled_back_stage(stage, model) -> None:
    """The pipeline's invariant: the cache holds the K/V of committed[:fed] at their own slots; not
    fed are the root and the tokens adopted from above since the last step (here at most one)."""
    assert len(stage.committed) - 2 <= stage.fed <= len(stage.committed) - 1
    k, v = kv_from_scratch(model, torch.tensor(stage.committed[: stage.fed]))
    assert_rows(stage.stage, torch.arange(stage.fed), k, v)


def greedy_after(model, tokens: list[int]) -> int:
    return int(chain_logits(model, torch.tensor(tokens))[-1].argmax())


def test_pipeline_stages_keep_every_verified_tokens_kv_through_random_rollbacks():
    """A verifying stage and a drafting stage, driven through random windows (their own greedy
    tokens, some corrupted), steps and CHECKs from above (rollbacks to random positions with random
    tokens, and extensions): after every event the cache equals a prefill of what is committed and
    fed, and every token a step committed is its model's greedy token there."""
    from specgraph.runtime.channel import Mail
    from specgraph.runtime.pipeline import CHECK

    rng = random.Random(0)
    prompt = [1, 450, 996, 1735, 1701, 2991]
    for index in (1, 0):
        stage = pipeline_stage(index)
        model = stage.stage.model
        vocab = model.served_vocab
        stage.start(prompt)
        stage.begin(prompt, 0)
        epoch = 0
        events = {"step": 0, "rollback": 0, "extension": 0}
        for _ in range(30):
            roll = rng.random()
            length = len(stage.committed)
            if roll < 0.25 and length > len(prompt):  # a CHECK from above
                extension = stage.fed == length - 1 and (rng.random() < 0.3 or not events["extension"])
                position = length + 1 if extension else rng.randint(len(prompt) + 1, length)
                epoch += 1
                token = rng.randrange(vocab)
                stage.handle(Mail(0, [CHECK, epoch, position, 1], [token]))
                events["extension" if extension else "rollback"] += 1
            elif index == 1 and roll < 0.6:  # tokens from below: the model's own greedy ones, some corrupted
                tokens, context = [], stage.committed + stage.pending
                for _ in range(rng.randint(1, 5)):
                    token = greedy_after(model, context) if rng.random() < 0.8 else rng.randrange(vocab)
                    tokens.append(token)
                    context = context + [token]
                stage.receive(stage.epoch_below, stage.pending_at + len(stage.pending), tokens)
            elif index == 0 or stage.pending:
                before = len(stage.committed)
                stage.step()
                events["step"] += 1
                best = chain_logits(model, torch.tensor(stage.committed)).argmax(-1)  # [T]: the greedy next token
                assert stage.committed[before:] == best[before - 1 : -1].tolist()
            check_rolled_back_stage(stage, model)
        assert all(events.values()), events


def test_a_first_stage_drafting_trees_keeps_its_kv_through_the_paths_it_is_sent():
    """A first stage that drafts trees commits only what CHECKs bring (a verified path and a token,
    or a rollback): after each, its cache equals a prefill of what it has fed, and a tree it drafts
    is rooted at its last committed token with the draft model's greedy children."""
    from specgraph.runtime.channel import Mail
    from specgraph.runtime.pipeline import CHECK

    rng = random.Random(1)
    prompt = [1, 450, 996, 1735, 1701, 2991]
    stage = pipeline_stage(0, {"shape": "static", "branching": [2, 2, 1]})
    model = stage.stage.model
    stage.start(prompt)
    stage.begin(prompt, 0)
    for epoch in range(1, 16):
        stage.step()
        assert stage.tree_out and stage.fed == len(stage.committed)
        length = len(stage.committed)
        sent = stage.mailbox.last  # the tree: its tokens, then its parents
        best = chain_logits(model, torch.tensor(stage.committed))[-1].topk(2).indices.tolist()
        assert sent[0] == stage.committed[-1] and sent[1:3] == best  # the root's children: the draft's top two
        if rng.random() < 0.7:  # the tree's path was accepted in part, then the verifier's own token
            tokens = [rng.randrange(model.served_vocab) for _ in range(rng.randint(1, 4))]
            position = length + len(tokens)
        else:  # a rollback from further up, to a random position
            tokens = [rng.randrange(model.served_vocab)]
            position = rng.randint(len(prompt) + 1, length)
        stage.handle(Mail(0, [CHECK, epoch, position, len(tokens)], tokens))
        assert not stage.tree_out and len(stage.committed) == position
        k, v = kv_from_scratch(model, torch.tensor(stage.committed[: stage.fed]))
        assert_rows(stage.stage, torch.arange(stage.fed), k, v)
        assert len(stage.committed) - stage.fed <= stage.drafter.max_feeds

"""Test helpers: recipes over the fixture models, and Markov-chain 'models' with known distributions."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from specgraph.draws import gumbel
from specgraph.models.widen import widen
from specgraph.cache import KVCache
from specgraph.draft import Drafter
from specgraph.engine.engine import Engine
from specgraph.engine.policy import Policy, StepCosts
from specgraph.engine.pool import BlockPool
from specgraph.engine.runner import Runner
from specgraph.layout import Layout
from specgraph.models.hybrid import HybridModel, to_hf_norms
from specgraph.models.llama import LlamaShape, hf_state
from specgraph.models.loader import load_model, safetensor_files
from specgraph.recipe import Recipe, SamplingSpec, VerifySpec
from specgraph.runtime.stage import Stage
from specgraph.runtime.verifier import Verifier
from specgraph.tree import Tree

REDUCED = LlamaShape(vocab_size=5000, hidden_size=640, intermediate_size=1536, num_layers=11, num_heads=8,
                     num_kv_heads=2, head_dim=128, rms_norm_eps=1e-5)  # 8B-like layout at a CPU-friendly size

# A prompt longer than an exported package's 64-token step (91 tokens for the embedded pair): a
# loaded program must feed it in chunks.
LONG_PROMPT = ('"""Read a list of paths, count the lines of each file and print a summary table."""\n'
               "import os\nimport sys\nfrom collections import Counter\n\n\ndef count_lines(path):\n    with open(path) as f:\n"
               "        return sum(1 for _ in f)\n\n\ndef main(argv):\n    totals = Counter()\n    for path in argv[1:]:\n")

def two_stage(target: Path, draft: Path | None, tree: dict | None = None, dtype: str = "float32",
              verify: dict | None = None, **fields) -> Recipe:
    """A recipe of `target` verified over `draft` (or the target alone when draft is None) with the
    target stage's `verify` section where given, on the CPU; every step speculating unless `serving`
    says otherwise (what a test of drafting asserts must not hang on a policy's choices, made from a
    busy CPU's timings: tests/test_policy.py tests those)."""
    fields["serving"] = {"speculation": "always", **fields.get("serving", {})}
    models = {"target": {"path": str(target), "dtype": dtype}}
    stages = [{"name": "target", "model": "target", "devices": ["cpu"]}]
    if draft is not None:
        models["draft"] = {"path": str(draft), "dtype": dtype}
        stages = [{"name": "draft", "model": "draft", "devices": ["cpu"], "tree": tree},
                  {**stages[0], "verifies": "draft", **({"verify": verify} if verify else {})}]
    return Recipe.from_dict({"name": "test", "models": models, "stages": stages, **fields})


class MarkovModel(nn.Module):
    """Next-token distribution depends only on the current token: logits = log(table[token])."""

    def __init__(self, table: torch.Tensor):  # [V, V], rows sum to 1
        super().__init__()
        self.register_buffer("log_table", table.log())
        self.served_vocab = table.shape[0]

    def new_cache(self, blocks: int, block_size: int, requests: int = 1, kernels=None) -> KVCache:
        return KVCache(0, 1, 1, blocks, block_size, torch.float32, "cpu")

    def forward(self, tokens, cache, layout, logits=True):
        return self.log_table[tokens] if logits else None  # [1, T, V]


def markov_engine(target: torch.Tensor, draft: torch.Tensor | None = None, plan=None, rule: str = "greedy",
                  sampling: SamplingSpec = SamplingSpec(), eos: tuple[int, ...] = (), max_seq_len: int = 64,
                  batch: int = 1, block_size: int = 16, kv_blocks: int | None = None) -> Engine:
    """An engine over Markov 'models' of next-token tables [V, V] (`draft` None: the target alone),
    drafting `plan` (a TreeTopology or DynamicTree), decoding up to `batch` requests at once."""
    cpu, capacity = torch.device("cpu"), max_seq_len + 32
    blocks = kv_blocks or 1 + batch * -(-capacity // block_size)

    def stage(name: str, table: torch.Tensor) -> Stage:
        return Stage(name, MarkovModel(table), capacity, cpu, requests=batch + 1, blocks=blocks, block_size=block_size)

    verifier = Verifier(stage("target", target), VerifySpec(), rule)
    drafter = None if draft is None else Drafter(stage("draft", draft), plan, rule)
    return Engine(Runner(verifier, drafter, batch, capacity), eos, max_seq_len, batch, BlockPool(blocks, block_size),
                  capacity - max_seq_len, 64, sampling)


def end_ids(hf: nn.Module) -> tuple[int, ...]:
    """The end-of-sequence ids of a transformers model's generation config (one, several or none)."""
    eos = hf.generation_config.eos_token_id
    return tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)


@torch.no_grad()
def hf_greedy(checkpoint: Path, prompts: list[dict], new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """transformers' greedy continuation (fp32) of each prompt's text: [(prompt ids, new ids)], all
    prompts in one `generate` (left-padded, masked: 5-6x faster on the CPU than one at a time, and the
    same tokens for the fixtures' 16 code prompts x 128, target and hybrid), each cut after its first
    end-of-sequence token as a generation of its own ends there."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    encoded = [tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in prompts]
    width = max(map(len, encoded))
    ends = end_ids(hf)
    pad = ends[0] if ends else 0  # (padding is masked out; after an end it is cut off below)
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in encoded])  # [prompts, width]
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in encoded])  # [prompts, width]
    new = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)[:, width:]
    continuations = []
    for row in new.tolist():
        end = next((i for i, token in enumerate(row) if token in ends), len(row) - 1)
        continuations.append(row[:end + 1])
    return list(zip(encoded, continuations))


@torch.no_grad()
def hf_continuation(hf: nn.Module, ids: list[int], new_tokens: int, served_vocab: int | None = None) -> list[int]:
    """The new ids of transformers' greedy `generate` after `ids` with the model `hf` (its config's
    end-of-sequence token ends it), choosing among its first `served_vocab` tokens only where given
    (a widened model's padding rows past them)."""
    padding = list(range(served_vocab, hf.config.vocab_size)) if served_vocab else None
    gen = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, suppress_tokens=padding)
    return gen[0, len(ids):].tolist()


def run_noting_projections(model: nn.Module, run):
    """Run `run()` with `model`'s projections noted on their way to its linear kernel -> (what run
    returns, the names of the model's nn.Linear modules whose weights that kernel never projected,
    gate/up aside: the SwiGLU kernel projects those)."""
    linear, given = model.kernels.linear, set()

    def noting(x, weight, bias):
        given.add(id(weight))
        return linear(x, weight, bias)

    model.use_kernels(replace(model.kernels, linear=noting))
    result = run()
    return result, {name for name, module in model.named_modules()
                    if isinstance(module, nn.Linear) and "gate_up" not in name and id(module.weight) not in given}


@torch.no_grad()
def chain_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids [T] run causally from an empty cache -> logits [T, V]."""
    return Stage("test", model, ids.numel() + 8, torch.device("cpu")).prefill(ids)


def grown_on_the_host(logits_after, committed: torch.Tensor, spec) -> tuple[list[int], list[int]]:
    """The dynamic tree of `spec` (a DynamicTree) by its definition, each node's logits from its
    whole path run alone (`logits_after(ids [T])` -> the next token's logits [V]): (tokens, parents)
    of the kept nodes, root first, in creation order."""
    tokens, parents, scores, leaves = [int(committed[-1])], [-1], [0.0], []

    def path(node: int) -> list[int]:
        return [] if node == 0 else path(parents[node]) + [tokens[node]]

    expanding = [0]
    for step in range(spec.depth):
        if step > 0:
            order = sorted(range(len(leaves)), key=lambda i: -scores[leaves[i]])  # stable: earlier first on ties
            expanding = [leaves[i] for i in order[: spec.width]]
            leaves = [n for n in leaves if n not in expanding]
        for parent in expanding:
            logits = logits_after(torch.cat([committed, torch.tensor(path(parent), dtype=torch.long)]))
            for token in logits.topk(spec.width).indices.tolist():
                tokens.append(token)
                parents.append(parent)
                scores.append(scores[parent] + float(logits.log_softmax(-1)[token]))
                leaves.append(len(tokens) - 1)
    keep = [0] + sorted(sorted(range(1, len(tokens)), key=lambda n: -scores[n])[: spec.nodes])
    index = {old: new for new, old in enumerate(keep)}
    return [tokens[n] for n in keep], [index.get(parents[n], -1) for n in keep]


class HostReads(TorchDispatchMode):
    """Records the ops that would make a GPU wait for the host (scalar reads, data-dependent shapes)
    or copy from the host (Python values turned into tensors), neither of which a CUDA graph can hold."""

    SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.SYNCING:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


PROMPT = "def parse(path):\n    with open(path) as f:\n"
# new tokens after PROMPT of a short check against transformers' greedy tokens (interpreted kernels, several
# processes): they pass four steps where the demo target's top two logits lie within 1 of each other (one within 0.01)
ORACLE_TOKENS = 24


def _splittable_checkpoint(name: str, folder: Path) -> Path:
    """The embedded fixture `name` widened (same function) to 6 query heads over 2 KV heads, saved in `folder`."""
    embedded = Path(__file__).resolve().parent.parent / "recipes" / "models" / name
    small = load_model(embedded, torch.float32, "cpu")
    wide = widen(small, replace(small.shape, num_heads=6, num_kv_heads=2), "cpu", torch.float32, tied=True)
    return save_checkpoint(wide, embedded, folder / name, num_attention_heads=6, num_key_value_heads=2)


def save_checkpoint(model: nn.Module, like: Path, checkpoint: Path, **config) -> Path:
    """`model` (tied embeddings) saved as a Hugging Face checkpoint in the folder `checkpoint`, with the
    tokenizer and config of the checkpoint `like`, the config's fields `config` changed."""
    checkpoint.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(like / file, checkpoint / file)
    (checkpoint / "config.json").write_text(json.dumps(json.loads((like / "config.json").read_text()) | config))
    state = hf_state(model)
    if isinstance(model, HybridModel):
        state = to_hf_norms(state)
    state = {f"model.{k}": v.contiguous() for k, v in state.items() if k not in ("inv_freq", "lm_head.weight")}
    save_file(state, checkpoint / "model.safetensors")
    return checkpoint


def shallow_hybrid(hybrid: Path, folder: Path, layers: int = 4) -> Path:
    """A small hybrid drafter for the hybrid checkpoint `hybrid`: its first `layers` layers (DeltaNet
    and attention), embeddings and final norm, saved in `folder` as a checkpoint of the same family and tokenizer."""
    model = load_model(hybrid, torch.float32, "cpu")
    model.layers = nn.ModuleList(model.layers[:layers])
    types = json.loads((hybrid / "config.json").read_text())["layer_types"][:layers]
    return save_checkpoint(model, hybrid, folder / "shallow_hybrid", num_hidden_layers=layers, layer_types=types)


def splittable_recipe(folder: Path, devices: str = "cpu") -> Path:
    """A recipe in `folder`: the draft fixture drafting for the target fixture, both widened (same
    function) to 6 query heads over 2 KV heads and saved as checkpoints, so that either splits over two devices."""
    target, draft = (_splittable_checkpoint(name, folder) for name in ("target", "draft"))
    recipe = folder / "tp.yaml"
    recipe.write_text(f"""name: tp
models: {{target: {{path: {target}, dtype: float32}}, draft: {{path: {draft}, dtype: float32}}}}
stages:
  - {{name: draft, model: draft, devices: [{devices}], tree: {{shape: chain, length: 3}}}}
  - {{name: target, model: target, devices: [{devices}], verifies: draft}}
max_new_tokens: 24
""")
    return recipe


def two_token_law(checkpoint: Path, ids: list[int], sampling: dict) -> dict[tuple[int, int], float]:
    """The exact probability of each pair of first two sampled tokens after `ids` under `sampling`
    (the checkpoint in fp32, through our module): {(a, b): p}."""
    from specgraph.recipe import SamplingSpec
    from specgraph.sampling import SamplingRows, probs_from_logits

    spec, model = SamplingRows.of([SamplingSpec(**sampling)], "cpu"), load_model(checkpoint, torch.float32, "cpu")
    first = probs_from_logits(chain_logits(model, torch.tensor(ids))[-1:], spec)[0]
    law = {}
    for a in first.nonzero().flatten().tolist():
        second = probs_from_logits(chain_logits(model, torch.tensor(ids + [a]))[-1:], spec)[0]
        for b in second.nonzero().flatten().tolist():
            law[(a, b)] = float(first[a] * second[b])
    return law


def law(outputs) -> dict[tuple[int, ...], float]:
    """The empirical law of the first two tokens of `outputs` (token lists)."""
    pairs = [tuple(output[:2]) for output in outputs]
    return {pair: pairs.count(pair) / len(pairs) for pair in set(pairs)}


def sampled_law(generate, samples: int) -> dict[tuple[int, ...], float]:
    """The empirical law of the first two tokens that `generate(seed)` returns over `samples` seeds."""
    return law(generate(seed) for seed in range(samples))


def seeded_generations(program, ids: list[int], samples: int) -> list:
    """The Generations of `samples` requests for two tokens after `ids`, seeds 0 to samples - 1, all
    added to `program`'s engine at once (it decodes max_batch of them a step; each request's draws
    come from its own seed's stream, as they would alone)."""
    engine = program.executor
    return [request.generation for request in decode_requests(
        engine, [{"prompt": ids, "new": 2, "sampling": engine.sampling.model_copy(update={"seed": seed})}
                 for seed in range(samples)])]


def total_variation(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0) - q.get(k, 0)) for k in set(p) | set(q))


def simulated_distances(law: dict, samples: int, to: dict | None = None, runs: int = 10_000) -> torch.Tensor:
    """The total variation from `to` (default: `law` itself) of the empirical law of `samples` draws
    from `law`, in each of `runs` simulated runs: [runs]. Sets a sampling test's bound (a quantile of
    the runs from the exact law) and checks its power (the runs from a wrong law must exceed it)."""
    outcomes = sorted(set(law) | set(to or law))
    drawn, target = (torch.tensor([p.get(o, 0.0) for o in outcomes], dtype=torch.float64) for p in (law, to or law))
    counts = torch.distributions.Multinomial(samples, drawn).sample((runs,))
    return 0.5 * (counts / samples - target).abs().sum(-1)


def weight_reads(monkeypatch) -> list[Path]:
    """The checkpoint files whose tensors the loader reads from now on (a model, or its embedding
    table alone), noted as it opens them: empty while no model has been loaded."""
    import specgraph.models.loader as loader

    reads = []
    for name in ("load_file", "safe_open"):
        read = getattr(loader, name)
        monkeypatch.setattr(loader, name, lambda file, *a, read=read, **k: reads.append(Path(file)) or read(file, *a, **k))
    return reads


def gone(pids: list[int], hang: float = 60.0) -> bool:
    """Whether every one of `pids` ends (a zombie has: its parent has not reaped it yet), waiting for
    those that end a moment after their parent (multiprocessing's resource tracker exits when it reads
    its parent's end of the pipe closed); False after `hang` seconds, which only end a hang."""
    import time

    deadline = time.monotonic() + hang
    while any(running(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    import subprocess

    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def descendants(pid: int) -> list[int]:
    return [d for child in children(pid) for d in [child, *descendants(child)]]


def interruptible() -> None:
    """A subprocess's preexec_fn: Ctrl-C's default action, whatever the test process inherited (a
    shell's background job ignores SIGINT, and its children would too)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def fault_ends_the_run(program, pid: int, sig: int, error: str, hang: float = 300.0) -> None:
    """Send `sig` to `pid` a second into a long request of a multi-process `program` (after a first
    request): the request must fail, not run to its end, with a one-line error matching `error`,
    which names its cause (a stage killed, or one silent for longer than the recipe's timeout: not
    the default timeout of 120 s), and no process of the program may be left. A request still
    running after `hang` seconds fails the test (its processes stopped)."""
    import os
    import re
    import threading

    from specgraph.errors import SpecgraphError

    pids = program.cluster.pids
    ids = program.encode(PROMPT)
    program.generate(ids, 4)
    threading.Timer(1.0, os.kill, (pid, sig)).start()
    ended = []
    request = threading.Thread(target=lambda: ended.append(raised(lambda: program.generate(ids, 2000))), daemon=True)
    request.start()
    request.join(hang)
    if request.is_alive():
        program.close(now=True)
        raise AssertionError(f"the request neither failed nor ended within {hang} s")
    assert isinstance(ended[0], SpecgraphError), f"the request did not fail with a one-line error: {ended[0]!r}"
    assert re.match(error, str(ended[0])), str(ended[0])
    assert gone(pids)


def raised(call) -> BaseException | None:
    """What `call()` raised, or None."""
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - returned to the test, which judges it
        return exc
    return None


def random_tree(t: int, generator: torch.Generator) -> Tree:
    parents = [-1] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, t)]
    return Tree(torch.zeros(1, t, dtype=torch.long), torch.tensor([parents]))


def random_layout(counts: list[int], prefixes: list[int], generator: torch.Generator, block_size: int = 16,
                  padding: int = 3, chains: bool = False, spare_rows: int = 2, device="cpu") -> Layout:
    """A packed forward of one segment per entry of `counts`: segment r writes a random tree (or a
    chain) of counts[r] tokens at virtual slots prefixes[r] + i (each sees its prefix, itself and
    its ancestors), then `padding` tokens of padding. The block table has `spare_rows` rows no
    segment uses and its blocks are shuffled, so every segment's slots are scattered in the pool."""
    r, g = len(counts), max(counts)
    capacity = max(p + c for p, c in zip(prefixes, counts))
    per_row = -(-capacity // block_size)
    rows_total = r + spare_rows
    table = (1 + torch.randperm(rows_total * per_row, generator=generator)).view(rows_total, per_row)
    rows = torch.randperm(rows_total, generator=generator)[:r]
    visible, offsets, positions = [], [], []
    for count, prefix in zip(counts, prefixes):
        rows_seen = torch.zeros(count, g, dtype=torch.bool)
        rows_seen[:, :count] = (torch.ones(count, count, dtype=torch.bool).tril() if chains
                                else random_tree(count, generator).ancestors[0])
        visible.append(rows_seen)
        offsets.append(torch.arange(count))
        positions.append(prefix + rows_seen[:, :count].sum(1) - 1)
    visible.append(torch.zeros(padding, g, dtype=torch.bool))
    offsets.append(torch.zeros(padding, dtype=torch.long))
    positions.append(torch.zeros(padding, dtype=torch.long))
    layout = Layout.build(table, block_size, rows, torch.tensor(prefixes), torch.tensor(counts), torch.cat(offsets),
                          torch.cat(visible), torch.cat(positions), per_row * block_size)
    return layout.to(device)


def path_alone(q, k, v, layout: Layout, token: int) -> torch.Tensor:
    """Packed token `token` of `layout` decoded alone ([1, H, K]): a one-token forward of a request
    of its own whose committed slots hold the token's segment's prefix and then its path (the
    region offsets it sees, in order) at their positions, in a pool of its own whose blocks lie
    elsewhere (virtual block b in physical block n - b of n)."""
    from specgraph.kernels.attention.invariant import attention_invariant  # a Triton module: imported when used
    from specgraph.layout import physical

    device, bs = k.device, layout.block_size
    r = int(torch.searchsorted(layout.cu[1:], torch.tensor(token, device=device), right=True))
    start = int(layout.starts[r])
    path = start + layout.visible[token].nonzero().flatten()  # its region slots, root first
    virtual = torch.cat([torch.arange(start, device=device), path])  # [p + 1]: positions 0..p of its request
    p = virtual.numel() - 1
    n = p // bs + 1
    table = torch.arange(n, 0, -1, device=device)[None]  # [1, n]
    src = physical(layout.table, bs, layout.rows[r], virtual)
    dst = physical(table, bs, torch.zeros((), dtype=torch.long, device=device), torch.arange(p + 1, device=device))
    k2, v2 = (x.new_zeros(1, x.shape[1], (n + 1) * bs, x.shape[3]) for x in (k, v))
    k2[:, :, dst], v2[:, :, dst] = k[:, :, src], v[:, :, src]
    one = torch.zeros(1, dtype=torch.long, device=device)
    alone = Layout.single(table, bs, torch.tensor(p, device=device), one, torch.ones(1, 1, dtype=torch.bool, device=device),
                          one + p, n * bs)
    return attention_invariant(q[:, :, token : token + 1].contiguous(), k2, v2, *alone.attention_inputs(q.shape[1]))[:, :, 0]


def gated_delta_layer(trees: list[tuple[int, int]], h: int, hk: int, dk: int, dv: int, pool: int, seed: int,
                      dtype: torch.dtype = torch.float32, spare: int = 2) -> tuple[list[Tree], tuple, tuple]:
    """A random gated-DeltaNet layer step on the CPU (scripts/bench_gated_delta.layer_inputs) over
    random trees of (nodes, depth) `trees`, their state in `pool` request slots, step buffers
    `spare` rows past the largest tree -> the trees, the step's arguments and its step buffers."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from bench_gated_delta import layer_inputs

    from specgraph.models.widen import QWEN35_REAL
    shape = replace(QWEN35_REAL["qwen3.5-9b"], linear_key_heads=hk, linear_value_heads=h, linear_key_dim=dk,
                    linear_value_dim=dv)
    gen = torch.Generator().manual_seed(seed)
    trees = [Tree.random(t, depth, gen) for t, depth in trees]
    args, steps = layer_inputs(shape, trees, gen, torch.device("cpu"), dtype, max(t.size for t in trees) + spare, pool)
    return trees, args, steps


def one_token_steps(args: tuple, steps: tuple, tree: int, path: list[int]
                    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The tokens of `path` (nodes of tree `tree` of the step `args`) decoded one at a time, each
    step committed, from the tree's committed state and conv window in a pool of their own (one
    slot; step buffers of one row, shaped like `steps`): their outputs [H, dv], and the state and
    conv window after the last."""
    from specgraph.kernels.gated_delta.invariant import gated_delta_commit_invariant, gated_delta_step_invariant
    from specgraph.models.hybrid import conv_windows

    inputs, write, decay_input, conv, conv_weight, a_log, dt_bias, _, _, state, rows = args
    slot = int(rows[tree])
    state, conv = state[slot][None, None].clone(), conv[slot][None, None].clone()  # one layer, one slot
    steps = tuple(torch.zeros_like(x[:1]) for x in steps)
    alone = torch.ones(1, 1, 1, dtype=torch.bool, device=inputs.device)
    first = torch.zeros(1, dtype=torch.long, device=inputs.device)  # the tree's slot, its step row, its node
    outs = []
    for node in path:
        token = (x[tree:tree + 1, node:node + 1] for x in (inputs, write, decay_input))
        outs.append(gated_delta_step_invariant(*token, conv[0], conv_weight, a_log, dt_bias,
                                               conv_windows(alone, conv_weight.shape[-1]), alone, state[0], first,
                                               *steps)[0, 0])
        gated_delta_commit_invariant(state, conv, *(x[None] for x in steps), first[None], first)
    return outs, state[0, 0], conv[0, 0]


def character_device(folder: Path, like: str = "null", name: str | None = None) -> Path:
    """A copy of /dev/`like` (null, full) in `folder` named `name` (default `like`), made with mknod
    (root only), so that a test that replaces it harms nothing; /dev/`like` itself where mknod is
    not permitted (there a non-root process cannot replace it either)."""
    import os
    import stat

    device = folder / (name or like)
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.stat(f"/dev/{like}").st_rdev)
    except PermissionError:
        return Path(f"/dev/{like}")
    return device


def read_fifo(path: Path):
    """Read the FIFO `path` in a thread (a writer's open blocks until a reader comes). The function
    returned waits for the bytes written (b"" if no writer came: it then ends the reader's wait by
    opening and closing the FIFO for writing itself) and fails after 10 s."""
    import os
    import threading
    import time

    got = []
    reader = threading.Thread(target=lambda: got.append(Path(path).read_bytes()), daemon=True)
    reader.start()

    def result() -> bytes:
        deadline = time.monotonic() + 10
        while reader.is_alive() and time.monotonic() < deadline:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a writer of nothing: EOF once the others closed
            except OSError:  # ENXIO: the reader has not opened the FIFO yet
                pass
            reader.join(0.05)
        assert not reader.is_alive(), f"{path}: the reader is still waiting"
        return got[0]

    return result


def unwritable_folder(folder: Path) -> tuple[Path, str]:
    """A folder in which no file can be created, and the OS's reason: a read-only folder (mode
    0555) in `folder` or, where permissions cannot refuse this process (root), /proc."""
    import os

    readonly = folder / "read-only"
    readonly.mkdir()
    readonly.chmod(0o555)
    for place in (readonly, Path("/proc")):
        try:
            os.close(os.open(place / "probe", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        except OSError as exc:
            return place, exc.strerror
        os.unlink(place / "probe")
    raise AssertionError(f"a file could be created in {readonly} and in /proc")


BUDGETS = [8, 48, 16, 64, 24, 40, 8, 56, 32, 12, 64, 20]  # new tokens of each of 12 requests: staggered finishes


def decode_requests(engine, requests: list[dict], after_step=None) -> list:
    """Every request ({"prompt": ids, "new": max new tokens} and optionally its "sampling", "stops" and
    "min_tokens", as Engine.add_request takes them) added to `engine` at once and decoded together
    (it admits max_batch of them): their handles, once done; `after_step(handles)` after each step."""
    handles = [engine.add_request(r["prompt"], r["new"], r.get("sampling"), stops=r.get("stops"),
                                  min_tokens=r.get("min_tokens", 0)) for r in requests]
    while engine.busy:
        engine.step()
        if after_step is not None:
            after_step(handles)
    return handles


def decode_together(program, reference, budgets=BUDGETS) -> list[list[int]]:
    """Every request in the engine at once (it admits max_batch of them), each with its own budget;
    the batch must have been full at times."""
    in_flight = []
    handles = decode_requests(program.executor, [{"prompt": ids, "new": budget}
                                                 for (ids, _), budget in zip(reference, budgets)],
                              lambda handles: in_flight.append(sum(h.status == "decode" for h in handles)))
    assert max(in_flight) == program.recipe.serving.max_batch
    return [h.generation.output_ids for h in handles]


def as_vision_language(hybrid: Path, folder: Path) -> Path:
    """The hybrid fixture in the layout Qwen3.5 is published in (Qwen3_5ForConditionalGeneration, as
    transformers builds it): the text model's config in text_config, its weights under
    model.language_model., beside a (small, random) vision tower and a multi-token-prediction tensor."""
    from safetensors.torch import load_file
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    text = transformers.AutoConfig.from_pretrained(hybrid)
    config = Qwen3_5Config(text_config={k: v for k, v in text.to_dict().items() if k != "architectures"},
                           vision_config={"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                                          "out_hidden_size": text.hidden_size},
                           tie_word_embeddings=text.tie_word_embeddings, architectures=["Qwen3_5ForConditionalGeneration"])
    config.save_pretrained(folder)
    vision = {k: v.contiguous() for k, v in Qwen3_5ForConditionalGeneration(config).state_dict().items()
              if k.startswith("model.visual.")}
    text_state = {k if k == "lm_head.weight" else "model.language_model." + k.removeprefix("model."): v
                  for file in safetensor_files(hybrid) for k, v in load_file(file).items()}
    save_file(text_state | vision | {"mtp.fc.weight": torch.zeros(8, 8)}, folder / "model.safetensors")
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (hybrid / file).is_file():
            shutil.copy(hybrid / file, folder / file)
    return folder


class Ledger:
    """Simulated time: every forward of a stage (Stage.forward, Stage.feed) adds its price, (seconds a forward,
    seconds a token), by stage name."""

    def __init__(self, prices: dict[str, tuple[float, float]]):
        self.prices, self.total = prices, 0.0

    @property
    def clock(self):
        """A Clock class (runtime/clock.py) on this simulated time."""
        ledger = self

        class Clock:
            def __init__(self, device=None):
                self.marks = []

            @staticmethod
            def now():
                return ledger.total

            def mark(self):
                self.marks.append(ledger.total)

            def seconds(self):
                return [b - a for a, b in zip(self.marks, self.marks[1:])]

        return Clock

    def charged(self, forward):
        """`forward(stage, tokens, layout)` (Stage.forward), charging each call its stage's price."""

        def charged(stage, tokens, layout):
            per_forward, per_token = self.prices[stage.name]
            self.total += per_forward + per_token * tokens.numel()
            return forward(stage, tokens, layout)

        return charged


class Cycling(Policy):
    """Runs its modes in turn (or those `order` names by index, over and over), whatever they cost:
    mode switches in the middle of every request."""

    def __init__(self, modes: list, order: list[int] | None = None):
        super().__init__(modes, StepCosts({m.name: {1: 1.0} for m in modes}))
        self.order = order or list(range(len(modes)))
        self.turn = 0

    def choose(self, acceptances, rows=None):
        self.turn += 1
        return self.modes[self.order[self.turn % len(self.order)]]


def filtered_log_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] (already divided by the temperature) -> log-probabilities [V] after top-k (every
    logit tied with the k-th kept) and top-p (the most likely tokens until their mass reaches
    top_p, every one tied with the last kept)."""
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    if top_p < 1:
        probs = logits.softmax(-1)
        ordered = probs.sort(descending=True).values
        last = ordered[(ordered.cumsum(0) - ordered) < top_p][-1]
        logits = logits.masked_fill(probs < last, float("-inf"))
    return logits.log_softmax(-1)


class Alone:
    """The target fixture in transformers (fp32), sampling by the keyed Gumbel-max."""

    def __init__(self, checkpoint: Path):
        self.model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
        self.eos = end_ids(self.model)  # what ends a request that names no stops

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def sample(self, ids: list[int], new: int, seed: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
               stops: tuple[int, ...] | None = None, min_tokens: int = 0) -> list[int]:
        stops = self.eos if stops is None else stops
        out, past, inputs = [], None, torch.tensor([ids])
        for i in range(new):
            step = self.model(inputs, past_key_values=past, use_cache=True)
            past, logits = step.past_key_values, step.logits[0, -1].float()
            if i < min_tokens and stops:
                logits[list(stops)] = float("-inf")
            scores = filtered_log_probs(logits / temperature, top_k, top_p)
            scores = scores + gumbel(torch.tensor(seed), torch.tensor(len(ids) + i), logits.numel())
            out.append(int(scores.argmax()))
            if out[-1] in stops:
                break
            inputs = torch.tensor([[out[-1]]])
        return out

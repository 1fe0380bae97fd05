"""validate: check that the recipe describes a topology this build can run, and read each
stage's checkpoint config.

Before: stages carry `spec` and `model`.
After:  + `config` (the Hugging Face config), `tokenizer` (its files: TokenizerFiles or None),
        `features` (an EAGLE-3 head's: the target layers whose inputs it reads; None elsewhere),
        `eos_ids` (token ids that end generation), `rule` (the verification rule in force),
        `vocab` (rows, width): a stage's logits are `width` wide (the target's vocabulary) and only
        their first `rows` may be proposed — a drafter whose checkpoint pads its vocabulary past the
        shared tokenizer's, or differently from its target's, never proposes a padding row.
"""

from __future__ import annotations

import json

from specgraph.errors import CheckpointError, RecipeError
from specgraph.graph import SpecGraph
from specgraph.hub import cache_folder
from specgraph.models.eagle import default_features
from specgraph.models.loader import head_shape, is_head, is_hybrid, read_config, read_tokenizer
from specgraph.passes.base import graph_pass
from specgraph.recipe import ChainTree, DynamicTree
from specgraph.recipe import StaticTree as StaticTreeSpec


@graph_pass(provides=("config", "tokenizer", "eos_ids", "rule", "vocab", "features"))
def validate(graph: SpecGraph) -> SpecGraph:
    recipe = graph.recipe
    stages = graph.stages()
    if recipe.execution == "disaggregated" and len(stages) != 2:
        raise RecipeError(f"stages: execution: disaggregated runs a drafter and a target, two stages (got {len(stages)})")
    if len(stages) > 2 and recipe.execution != "pipeline":
        raise RecipeError(f"stages: {len(stages)} stages form a hierarchy, which needs execution: pipeline; "
                          f"execution: {recipe.execution} runs one target with at most one drafter")
    if recipe.execution == "pipeline":
        _check_pipeline(graph)
    else:
        for name in stages:
            if graph.node(name)["spec"].verify.window is not None:
                raise RecipeError(f"stages.{graph.node(name)['index']}.verify.window: windows are verified only with "
                                  "execution: pipeline")
    target = stages[-1]
    for name in stages:
        node = graph.node(name)
        spec, index = node["spec"], node["index"]
        try:
            node["config"] = read_config(node["model"].path)
        except CheckpointError as exc:
            hub_id = getattr(node["model"].path, "hub_id", None)
            if hub_id is not None:  # (neither a folder nor in the cache: recipe.NotFound)
                raise CheckpointError(f"models.{spec.model}.path: {hub_id} is neither a folder ({node['model'].path}) "
                                      f"nor a model in the Hugging Face cache ({cache_folder()}); download it there "
                                      f"(hf download {hub_id}), or give a checkpoint folder") from None
            raise CheckpointError(f"models.{spec.model}.path: {exc}") from None
        node["tokenizer"] = read_tokenizer(node["model"].path)
        node["eos_ids"] = _eos_ids(node)
        node["rule"] = _rule(spec.verify.rule, recipe.sampling.temperature, index)
        _check_window(node, recipe.max_seq_len)
        if name != target and is_hybrid(node["config"]):
            _check_hybrid_drafter(recipe.execution, spec, index, node["config"].architectures[0])
        if spec.tree is not None and name == target:
            raise RecipeError(f"stages.{index}.tree: the last stage drafts for no one; "
                              "put the tree on the stage it verifies")
        if isinstance(spec.tree, DynamicTree):
            _check_dynamic(spec.tree, index)
        if spec.tree is not None:
            _check_tree_fits(spec.tree, index, recipe.max_seq_len)
        if spec.verify.budget is not None:
            _check_budget(graph, name)
        if getattr(node["config"], "quantization_config", None) is not None and len(spec.devices) > 1:
            raise RecipeError(f"stages.{index}.devices: models.{spec.model} has quantized weights, which run on one "
                              f"device (tensor parallelism over quantized weights is not supported); give it one device")
    for name in stages:
        graph.node(name)["features"] = _check_head(graph, name, target) if is_head(graph.node(name)["config"]) else None
    _plan_vocabularies(graph, target)
    if recipe.lowering.row_invariant:
        _check_row_invariant(graph.node(target))
    return graph


def _check_head(graph: SpecGraph, name: str, target: str) -> tuple[int, ...]:
    """An EAGLE-3 head drafts (in the serial executor; static trees in the disaggregated one; on one
    device) for a Llama-family target of its vocabulary and width, from layers the target has -> those layers."""
    node, ref = graph.node(name), graph.node(target)
    model, index, config = node["spec"].model, node["index"], ref["config"]
    what = f"stages.{index}.model: models.{model} is an EAGLE-3 head"
    if name == target:
        raise RecipeError(f"{what}, which drafts from a target's features; it cannot be the target")
    execution = graph.recipe.execution
    if execution not in ("serial", "disaggregated"):
        raise RecipeError(f"{what}, which drafts under execution: serial or disaggregated (got {execution})")
    tree = node["spec"].tree
    if execution == "disaggregated" and not isinstance(tree, StaticTreeSpec):
        raise RecipeError(f"{what}, which drafts static trees under execution: disaggregated (drafted anew from "
                          f"each verdict's features; got a {getattr(tree, 'shape', 'chain')} tree); give a static tree, or execution: serial")
    if len(node["spec"].devices) > 1:
        raise RecipeError(f"{what}, which runs on one device (got {len(node['spec'].devices)})")
    if execution == "serial" and node["spec"].devices != ref["spec"].devices[:1] * len(ref["spec"].devices):
        raise RecipeError(f"{what}, which drafts beside its target in serial execution: give it the target's one "
                          f"device ({ref['spec'].devices}), or execution: disaggregated for a head of its own device")
    dtypes = [graph.recipe.models[n["spec"].model].dtype for n in (node, ref)]
    if dtypes[0] != dtypes[1]:
        raise RecipeError(f"{what}, which runs in its target's dtype: give models.{model}.dtype {dtypes[1]!r} "
                          f"(got {dtypes[0]!r})")
    if is_hybrid(config):
        raise RecipeError(f"{what}, which drafts for a Llama-family target; models.{ref['spec'].model} is a hybrid "
                          f"({config.architectures[0]})")
    shape = head_shape(node["config"], node["model"].path)
    if shape.layer.vocab_size != config.vocab_size or shape.target_hidden_size != config.hidden_size:
        raise CheckpointError(f"models.{model}: the head is for a target of vocab_size {shape.layer.vocab_size} and "
                              f"hidden_size {shape.target_hidden_size}; models.{ref['spec'].model} has "
                              f"{config.vocab_size} and {config.hidden_size}")
    layers = shape.features or default_features(config.num_hidden_layers)
    if not all(0 <= i < config.num_hidden_layers for i in layers):
        raise CheckpointError(f"models.{model}: the head reads target layers {list(layers)}; models."
                              f"{ref['spec'].model} has {config.num_hidden_layers} (0..{config.num_hidden_layers - 1})")
    return tuple(layers)


def _check_row_invariant(node: dict) -> None:
    """What lowering.row_invariant makes exact: a target on one device or two (a sum of two ranks'
    parts does not depend on their order)."""
    if len(node["spec"].devices) > 2:
        raise RecipeError(f"lowering.row_invariant: stages.{node['index']}.devices: a sum over more than two "
                          "tensor-parallel ranks depends on their order; give the target one or two devices")


def _check_hybrid_drafter(execution: str, spec, index: int, architecture: str) -> None:
    """A hybrid drafts a tree anew each step (its recurrent state follows the committed tokens only),
    so not below the last stage of a pipeline, whose stages verify windows they keep (plan_tree
    refuses it a tree that grows across verdicts)."""
    if execution == "pipeline":
        raise RecipeError(f"stages.{index}.model: models.{spec.model} is a hybrid model ({architecture}), which runs "
                          "in a pipeline only as the last stage; use a Llama-family model below it")


def _check_pipeline(graph: SpecGraph) -> None:
    stages = graph.stages()
    if len(stages) < 2:
        raise RecipeError("stages: execution: pipeline needs at least two stages (a drafter and the stages that verify it)")
    first_tree = graph.node(stages[0])["spec"].tree or ChainTree()
    for name in stages:
        spec, index = graph.node(name)["spec"], graph.node(name)["index"]
        if index == 1 and spec.verify.window is not None and not isinstance(first_tree, ChainTree):
            raise RecipeError("stages.1.verify.window: the stage above a first stage that drafts a tree verifies "
                              "the whole tree; give the tree's size instead (stages.0.tree)")
        if index > 0 and spec.tree is not None:
            raise RecipeError(f"stages.{index}.tree: in a pipeline only the first stage drafts; stage {name} passes "
                              "on what it verifies (its window: verify.window)")
        if index == 0 and spec.verify.window is not None:
            raise RecipeError("stages.0.verify.window: the first stage verifies nothing; give the window to the stages above")


def _rule(rule: str | None, temperature: float, index: int) -> str:
    if rule is None:
        return "greedy" if temperature == 0 else "sampling"
    if rule == "greedy" and temperature > 0:
        raise RecipeError(f"stages.{index}.verify.rule: 'greedy' needs sampling.temperature 0 "
                          f"(got {temperature}); use 'sampling' to keep the target distribution")
    if rule == "sampling" and temperature == 0:
        raise RecipeError(f"stages.{index}.verify.rule: 'sampling' needs sampling.temperature > 0; "
                          "use 'greedy' at temperature 0")
    return rule


def _eos_ids(node: dict) -> tuple[int, ...]:
    eos = node["config"].eos_token_id
    generation = node["model"].path / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def _check_window(node: dict, max_seq_len: int) -> None:
    config, spec = node["config"], node["spec"]
    window = getattr(config, "sliding_window", None)
    if window and window < max_seq_len:
        raise RecipeError(f"max_seq_len: {max_seq_len} exceeds models.{spec.model}'s sliding window {window}, "
                          f"which is not supported yet; set max_seq_len <= {window}")
    if config.max_position_embeddings < max_seq_len:
        raise RecipeError(f"max_seq_len: {max_seq_len} exceeds models.{spec.model}'s max_position_embeddings "
                          f"{config.max_position_embeddings}")


def _check_budget(graph: SpecGraph, name: str) -> None:
    """A budget ranks the nodes of every request's dynamic tree (the serial executor's engine)."""
    node = graph.node(name)
    where = f"stages.{node['index']}.verify.budget"
    if graph.recipe.execution != "serial":
        raise RecipeError(f"{where}: a batch-wide budget needs execution: serial (its engine decodes many requests at "
                          f"once); execution {graph.recipe.execution} decodes one")
    drafter = graph.drafter_of(name)
    if drafter is None or not isinstance(graph.node(drafter)["spec"].tree, DynamicTree):
        raise RecipeError(f"{where}: a budget takes the most likely nodes of dynamic trees; give the stage it verifies "
                          "tree: {shape: dynamic, width: W, depth: D, nodes: N}")


def _check_dynamic(tree: DynamicTree, index: int) -> None:
    grown = tree.width + (tree.depth - 1) * tree.width ** 2
    if tree.nodes > grown:
        raise RecipeError(f"stages.{index}.tree.nodes: {tree.nodes} exceeds the {grown} nodes that width "
                          f"{tree.width} and depth {tree.depth} grow; valid: 1..{grown}")


def _check_tree_fits(tree: ChainTree | StaticTreeSpec | DynamicTree, index: int, max_seq_len: int) -> None:
    """A step writes its tree and root (a dynamic drafter: every node it feeds) past the committed
    tokens, all of them at most max_seq_len: a larger tree could never be accepted whole, and
    planning it would take time and memory that grow with the square of its size. Counted from
    the spec, before any tree is built."""
    if isinstance(tree, ChainTree):
        what, tokens = f"a chain of {tree.length} draft tokens", tree.length + 1
    elif isinstance(tree, DynamicTree):
        fed = (tree.depth - 1) * tree.width
        what, tokens = (f"{tree.nodes} verified nodes", tree.nodes + 1) if tree.nodes + 1 > fed else (
            f"depth {tree.depth} x width {tree.width} ({fed} nodes fed per step)", fed)
    elif tree.branching is not None:
        tokens, level = 1, 1
        for children in tree.branching:
            level *= children
            tokens += level
            if tokens > max_seq_len:
                break
        what = f"branching {tree.branching} ({tokens - 1}{'+' if tokens > max_seq_len else ''} nodes)"
    else:
        what, tokens = f"{len(tree.paths)} paths", len({tuple(p) for p in tree.paths}) + 1
    if tokens > max_seq_len:
        raise RecipeError(f"stages.{index}.tree: {what} cannot fit max_seq_len {max_seq_len}: a step writes at most "
                          f"max_seq_len tokens, the tree's and its root's; give a smaller tree, or a larger max_seq_len")


def _plan_vocabularies(graph: SpecGraph, target: str) -> None:
    """Every drafter shares the target's tokenizer; its logits are cut or padded to the target's
    vocabulary, and only ids the tokenizer and both models have may be proposed (see the module doc)."""
    ref = graph.node(target)
    width, tokenizer = ref["config"].vocab_size, ref["tokenizer"]
    ref["vocab"] = (width, width)  # the target is never masked: its greedy output is its own
    for name in graph.stages()[:-1]:
        node = graph.node(name)
        model, own = node["spec"].model, node["config"].vocab_size
        if None not in (node["tokenizer"], tokenizer) and node["tokenizer"].fingerprint != tokenizer.fingerprint:
            raise CheckpointError(f"models.{model}: tokenizer differs from models.{ref['spec'].model}'s; "
                                  "a draft must share the target's tokenizer")
        size = tokenizer.size if tokenizer is not None and node["tokenizer"] is not None else None
        if own != width and size is None:
            raise CheckpointError(f"models.{model}: vocab_size {own} differs from models.{ref['spec'].model}'s "
                                  f"{width}, and without a tokenizer.json in both folders the ids they share are "
                                  "unknown; give both checkpoints their tokenizer files")
        rows = min(own, width, size or width)
        node["vocab"] = (rows, width)

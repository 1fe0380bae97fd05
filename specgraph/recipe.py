"""The recipe: a typed, validated description of a decoding topology.

A recipe is read once (from YAML, a dict or Python keyword arguments) into the
pydantic objects below; everything after this module works on typed objects.
Relative model paths resolve against the recipe's folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specgraph.errors import RecipeError
from specgraph.files import read_text
from specgraph.hub import cached_snapshot, is_hub_id


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """A Hugging Face checkpoint folder (config.json + *.safetensors), or a hub id in the local cache."""

    path: Path = Field(description="checkpoint folder (relative paths resolve against the recipe's folder), or a "
                       "Hugging Face hub id (org/name) found in the local cache (HF_HOME), offline")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weight and activation dtype; auto = float32 on cpu, bfloat16 on cuda"
    )

    @field_validator("path")
    @classmethod
    def _resolve(cls, path: Path, info: ValidationInfo) -> Path:
        """Against the recipe's folder; where no folder is there and the path reads as a hub id, the
        cache's snapshot of it (else a NotFound that says what was looked for)."""
        base = (info.context or {}).get("base_dir")
        resolved = path if path.is_absolute() or base is None else Path(base) / path
        if resolved.exists() or not is_hub_id(path.as_posix()):
            return resolved
        snapshot = cached_snapshot(path.as_posix())
        return snapshot if snapshot is not None else NotFound.of(resolved, path.as_posix())


class NotFound(type(Path())):
    """A model path that names no folder, given as a hub id that the local cache lacks too (the
    validate pass says both); equal to the plain path."""

    hub_id: str

    @classmethod
    def of(cls, path: Path, hub_id: str) -> NotFound:
        missing = cls(path)
        missing.hub_id = hub_id
        return missing


class ChainTree(_Strict):
    """A single sequence of `length` draft tokens."""

    shape: Literal["chain"] = Field("chain", description="this tree's kind")
    length: PositiveInt = Field(4, description="draft tokens per step")


class StaticTree(_Strict):
    """A fixed tree: `branching` (children per depth) or explicit `paths` of child ranks."""

    shape: Literal["static"] = Field("static", description="this tree's kind")
    branching: list[PositiveInt] | None = Field(None, description="children of every node at each depth")
    paths: list[list[NonNegativeInt]] | None = Field(
        None, description="each path a sequence of child ranks from the root (Medusa-style)"
    )

    @model_validator(mode="after")
    def _one_form(self) -> StaticTree:
        if (self.branching is None) == (self.paths is None):
            raise ValueError("give exactly one of 'branching' or 'paths'")
        if self.branching is not None and not self.branching:
            raise ValueError("'branching' needs at least one depth, e.g. [4, 2, 1]")
        if self.paths is not None:
            if not self.paths or any(not p for p in self.paths):
                raise ValueError("'paths' needs at least one non-empty path, e.g. [[0], [1], [0, 0]]")
            given = {tuple(p) for p in self.paths}
            for p in given:
                if len(p) > 1 and p[:-1] not in given:
                    raise ValueError(f"path {list(p)} has no parent path {list(p[:-1])}")
                if p[-1] > 0 and (*p[:-1], p[-1] - 1) not in given:
                    raise ValueError(f"path {list(p)} skips its elder sibling {[*p[:-1], p[-1] - 1]}")
        return self


class DynamicTree(_Strict):
    """Maximum-likelihood expansion: grow the `width` most likely leaves per step for `depth`
    steps, then verify the `nodes` most likely nodes by cumulative log-probability."""

    shape: Literal["dynamic"] = Field("dynamic", description="this tree's kind")
    width: PositiveInt = Field(4, description="leaves expanded per step, and children per expanded leaf")
    depth: PositiveInt = Field(4, description="expansion steps (maximum tree depth)")
    nodes: PositiveInt = Field(16, description="draft nodes verified per step (the root not counted)")


TreeSpec = Annotated[Union[ChainTree, StaticTree, DynamicTree], Field(discriminator="shape")]


class BudgetSpec(_Strict):
    """Bole's batch-wide verification budget: with c requests in a step, verify the B(c) most likely
    draft nodes over all of their trees (each request at most its dynamic tree's `nodes`), B(c) =
    max{N : T_ver(N | c) <= (1 + epsilon) T_dec(c)}: the most nodes whose verification costs at
    most (1 + epsilon) times a step of the c roots alone, measured on this machine."""

    epsilon: float = Field(0.1, ge=0, description="how much more than a plain decoding step verification may cost")
    nodes: dict[PositiveInt, NonNegativeInt] | None = Field(
        None, description="B(c) by batch size c, as calibrated (between two sizes, the smaller's share per request); "
        "default: calibrated when the program loads, at batch sizes 1, 2, 4, ... up to serving.max_batch")


class VerifySpec(_Strict):
    """How a stage accepts the drafts of the stage it verifies."""

    rule: Literal["greedy", "sampling", "typical"] | None = Field(
        None,
        description="greedy (exact, temperature 0); sampling (temperature > 0: each token the argmax of the "
        "target's log-probabilities plus Gumbel noise keyed by the seed, its position and the token, so every recipe "
        "samples exactly the tokens of the target alone with the same seed; the drafter proposes with the same "
        "noise); typical (lossy typical acceptance, opt-in); default: greedy at temperature 0, else sampling",
    )
    typical_threshold: float = Field(0.09, gt=0, le=1, description="typical: hard probability floor epsilon")
    typical_alpha: float = Field(0.3, gt=0, le=1, description="typical: entropy-scaled floor delta")
    window: PositiveInt | None = Field(
        None, description="execution: pipeline: most tokens of the stage below verified in one forward; "
        "default: the first stage's chain length")
    budget: BudgetSpec | None = Field(
        None, description="verify a budget of nodes over the whole batch (Bole), the most likely of all requests' "
        "dynamic trees, instead of each request's tree whole; serial execution")

    @field_validator("rule", mode="before")
    @classmethod
    def _not_residual(cls, rule):
        if rule == "residual":  # (a recipe of before issue 54)
            raise ValueError("the residual rule was deleted; 'sampling', lossless too, replaced it (it accepts more "
                             "drafts); the rules are 'greedy', 'sampling' or 'typical'")
        return rule


class GrowSpec(_Strict):
    """How a drafter keeps growing its tree while the target verifies what it sent (execution:
    disaggregated; chain and dynamic trees)."""

    steps: NonNegativeInt | None = Field(
        None, description="expansion steps per verdict; default: the tree's depth - 1. Best when they take about as "
        "long as the target's verification (`specgraph bench` reports each side's busy share)")
    leaves: PositiveInt | None = Field(
        None, description="leaves fed per expansion step; default: the tree's width on the CPU, 16 (or the width, if "
        "more) on a GPU, where a step costs about the same for more, which cover more of the tokens a verdict may bring")
    first: PositiveInt | None = Field(
        None, description="expansion steps (the root's included) before a fresh tree is sent, when a verdict's "
        "bonus token is not in the tree; default: 2 (at most the depth). More give a better tree, later")


class StageSpec(_Strict):
    """A node of the graph: one model on one device partition."""

    name: str = Field(min_length=1, description="the stage's name, which `verifies` and reports use")
    model: str = Field(description="key into `models`")
    devices: list[str] = Field(["auto"], min_length=1, description="cpu, cuda:N or auto; TP over the list (serial "
                                 "execution: a process runs every stage on its one device)")
    tree: TreeSpec | None = Field(None, description="draft-tree shape, for a stage that others verify")
    grow: GrowSpec | None = Field(None, description="execution: disaggregated: how this drafter grows its tree "
                                  "while the target verifies")
    verifies: str | None = Field(None, description="name of the stage whose drafts this stage verifies")
    verify: VerifySpec = Field(VerifySpec(), description="how this stage accepts the drafts of the one it verifies")


class SamplingSpec(_Strict):
    """How tokens are drawn, for draft and target alike: at temperature 0, greedily; a request of
    the server may give its own."""

    temperature: float = Field(0.0, ge=0, description="0: greedy (the argmax); above 0: sampled at this temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="keep the most likely tokens until their mass reaches top_p")
    top_k: NonNegativeInt = Field(0, description="keep the k most likely tokens; 0 = no top-k filter")
    seed: int = Field(0, description="what keys a request's sampling: under the sampling rule a prompt, its "
                      "settings and a seed give the tokens the target alone samples with that seed, whatever the "
                      "drafter, tree, batch, budget or executor (on a GPU in bf16, where the target's logits are the "
                      "same bits: `lowering.row_invariant`); under typical, tokens repeat only where "
                      "every step's tree is fixed. A server request without a seed gets a fresh one")


KernelKind = Literal["auto", "reference", "triton"]


class LoweringSpec(_Strict):
    """How stages are lowered to step programs."""

    compile: bool | None = Field(None, description="torch.compile the decoder layers; default: on GPUs, not on the CPU")
    cuda_graphs: bool = Field(True, description="capture and replay CUDA graphs: whole steps where they allow, else one per forward size (GPU)")
    kernels: KernelKind | dict[str, KernelKind] = Field(
        "auto", description="fused-op implementations: auto (Triton where it pays on a GPU), reference (plain PyTorch), "
        "triton; or one per op, e.g. {gated_delta_step: reference} (ops not named: auto; naming the gated-DeltaNet "
        "step or commit names both)")
    row_invariant: bool = Field(
        False, description="the target's projections and attention give each token the same bits in a tree step as "
        "in a one-token step (Triton kernels of fixed tiling), so greedy speculation in bf16 on a GPU reproduces the "
        "target's own greedy output exactly, alone or in any batch; Llama-family and Qwen3.5 targets on one or two devices")

    @field_validator("kernels")
    @classmethod
    def _known_ops(cls, kernels):
        from specgraph.kernels import TRITON
        unknown = sorted(set(kernels) - set(TRITON)) if isinstance(kernels, dict) else []
        if unknown:
            raise ValueError(f"no fused op named {', '.join(unknown)}; the ops are {', '.join(TRITON)}")
        return kernels


class PipelineSpec(_Strict):
    """execution: pipeline: how the stages run together."""

    synchronous: bool = Field(False, description="each stage waits for the one above to verify a window of its "
                              "tokens before it goes on (PipeSpec's synchronous ablation); default: every stage runs "
                              "at once, rolled back by the stages above")
    ahead: PositiveInt | None = Field(None, description="tokens a stage may produce beyond what the stage above has "
                                      "verified; default: twice the window above (one window when synchronous)")


class ServingSpec(_Strict):
    """How the serial executor serves many requests at once (specgraph/engine/)."""

    max_batch: PositiveInt = Field(1, description="requests decoded together at most; more wait their turn "
                                   "(`specgraph run --batch N`)")
    block_size: PositiveInt = Field(64, description="KV slots per block of the pool: a power of two, at least 16")
    kv_blocks: PositiveInt | None = Field(None, description="blocks of the KV pool (each stage holds as many, of its "
                                          "own size); default: enough for max_batch requests of max_seq_len tokens. "
                                          "A request is admitted once the blocks of its prompt and new tokens are free")
    prefill_chunk: PositiveInt = Field(512, description="most prompt tokens fed in one step, over the newcomers, "
                                       "earliest first: they delay the requests being decoded by one chunk at most")
    speculation: Literal["adaptive", "always"] = Field(
        "adaptive", description="adaptive: each step runs plain decoding or speculation at one of the drafter's tree "
        "depths, whichever is expected to give the batch the most tokens per second (step times measured when the "
        "program loads, acceptance as the requests go; an EAGLE-3 head's modes add chains); always: every step "
        "speculates with the recipe's tree. Either way sampled output follows the target's "
        "distribution, and under the sampling rule a seed gives the same tokens whichever steps speculate")
    max_waiting: NonNegativeInt | None = Field(None, description="specgraph serve: requests waiting for a place in "
                                               "the batch at most, more refused (503, Retry-After) until some finish; "
                                               "default: every request waits its turn (its prompt in host memory)")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, size: int) -> int:
        if size < 16 or size & (size - 1):
            raise ValueError("must be a power of two of at least 16, e.g. 64")
        return size


class Recipe(_Strict):
    """A decoding topology (docs/design.md). `name` is required in a dict or Python recipe; a YAML
    file's defaults to the file's stem."""

    name: str = Field(min_length=1, description="the recipe's name (the model id `specgraph serve` answers to)")
    models: dict[str, ModelSpec] = Field(min_length=1, description="the checkpoints, by the names stages give them")
    stages: list[StageSpec] = Field(min_length=1, description="smallest model first")
    execution: Literal["serial", "disaggregated", "pipeline"] = Field(
        "serial", description="serial: draft, then verify, many requests at once (the engine); disaggregated "
        "(SwiftSpec): drafter and target in processes of their own, at the same time; pipeline (PipeSpec): each "
        "stage verifying the one below, all at once")
    sampling: SamplingSpec = Field(SamplingSpec(), description="how tokens are drawn")
    max_new_tokens: PositiveInt = Field(256, description="new tokens per prompt at most, unless a command or "
                                        "request gives another budget")
    max_seq_len: int = Field(2048, ge=2, description="prompt + generated tokens that the caches hold: at least 2 (a "
                             "one-token prompt and one new token)")
    prompt: str | None = Field(None, description="prompt used when the command line gives none")
    lowering: LoweringSpec = Field(LoweringSpec(), description="kernels, compilation and CUDA graphs")
    pipeline: PipelineSpec = Field(PipelineSpec(), description="execution: pipeline: how its stages run together")
    serving: ServingSpec = Field(ServingSpec(), description="the engine: requests at once, the KV pool, prefill")
    timeout: float = Field(120.0, gt=0, description="multi-process runs: seconds a process may wait on another stage, "
                           "or spend in one step, before the run stops with an error naming the stage and rank "
                           "(ten times this during the first request, where compilation and graph capture happen)")

    @classmethod
    def from_dict(cls, data: Any, base_dir: Path | str | None = None) -> Recipe:
        try:
            return cls.model_validate(data, context={"base_dir": base_dir})
        except ValidationError as exc:
            raise RecipeError(describe_validation_error(exc)) from None

    @classmethod
    def from_yaml(cls, path: Path | str, overrides: list[str] = ()) -> Recipe:
        path = Path(path)
        if path.is_dir():
            raise RecipeError(f"recipe: {path} is a folder; a recipe is a YAML file")
        if not path.is_file():
            raise RecipeError(f"recipe file {path} does not exist")
        try:
            data = yaml.safe_load(read_text(path, "recipe"))
        except yaml.YAMLError as exc:
            raise RecipeError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise RecipeError(f"{path}: a recipe is a YAML mapping with keys name, models, stages, ...")
        data.setdefault("name", path.stem)  # a file's recipe is named after it unless it says otherwise
        for override in overrides:
            apply_override(data, override)
        return cls.from_dict(data, base_dir=path.parent)

    @classmethod
    def of_models(cls, target: str, draft: str | None = None, overrides: list[str] = ()) -> Recipe:
        """The recipe of `specgraph serve MODEL [--draft MODEL]`: the target alone (plain decoding),
        or verifying `draft`'s default tree; named after the target as given, paths (or hub ids)
        as given (relative ones from the working folder)."""
        models = {"target": {"path": target}} | ({"draft": {"path": draft}} if draft is not None else {})
        stages = [{"name": "target", "model": "target"}]
        if draft is not None:
            stages = [{"name": "draft", "model": "draft"}, stages[0] | {"verifies": "draft"}]
        data = {"name": target, "models": models, "stages": stages}
        for override in overrides:
            apply_override(data, override)
        return cls.from_dict(data)

    def with_tree(self, stage: int, tree: TreeSpec) -> Recipe:
        """This recipe with stage number `stage` drafting `tree`."""
        stages = list(self.stages)
        stages[stage] = stages[stage].model_copy(update={"tree": tree})
        return self.model_copy(update={"stages": stages})

    def to_yaml(self, folder: Path | str) -> str:
        """The recipe as YAML for a file in `folder`: the fields it was given (defaults left out),
        model paths relative to `folder` (from_yaml resolves them from the file's folder)."""
        folder = Path(folder).resolve()
        models = {name: spec.model_copy(update={"path": Path(os.path.relpath(spec.path.resolve(), folder))})
                  for name, spec in self.models.items()}
        data = self.model_copy(update={"models": models}).model_dump(mode="json", exclude_unset=True)
        return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=None, allow_unicode=True, width=120)


class _Dumper(yaml.SafeDumper):
    """Multi-line text (a prompt) as a literal block, as a person writes it."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def apply_override(data: dict, override: str) -> None:
    """Apply one `dotted.path=value` override (value parsed as YAML) to raw recipe data in place."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise RecipeError(f"--set {override!r}: expected KEY=VALUE, e.g. stages.0.devices=[cpu]")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:  # not YAML: take it as plain text (e.g. a prompt)
        value = raw
    parts = key.split(".")
    node: Any = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"--set {key}: {where} is not an index of a list of {len(node)}")
            part = int(part)
        elif not isinstance(node, dict):
            raise RecipeError(f"--set {key}: {'.'.join(parts[:depth])} is not a mapping or list")
        if last:
            node[part] = value
        else:
            if isinstance(node, dict) and part not in node:
                node[part] = {}
            node = node[part]


def describe_validation_error(exc: ValidationError) -> str:
    """One line: the first error's field path and what would be valid."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"] if p not in ("chain", "static", "dynamic")]
    where = ".".join(loc) or "recipe"
    if err["type"] == "extra_forbidden":
        valid = _fields_at(err["loc"][:-1])
        return f"{where}: unknown key; valid keys here: {', '.join(valid)}"
    if err["type"] == "missing":
        return f"{where}: required field is missing"
    msg = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
    return f"{where}: {msg}{shown}"


def _fields_at(loc: tuple) -> list[str]:
    """Field names of the schema object found by walking `loc` from Recipe."""
    model: Any = Recipe
    walk = {"models": ModelSpec, "stages": StageSpec, "sampling": SamplingSpec, "verify": VerifySpec, "grow": GrowSpec,
            "lowering": LoweringSpec, "pipeline": PipelineSpec, "serving": ServingSpec,
            "chain": ChainTree, "static": StaticTree, "dynamic": DynamicTree, "budget": BudgetSpec}
    for part in loc:
        model = walk.get(part, model) if isinstance(part, str) else model
    return list(model.model_fields)

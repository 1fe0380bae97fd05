"""Export: each stage's step program as a torch.export + AOTInductor package, plus a manifest.

A package holds one stage's forward (weights included) for any number of new tokens T from 1
to its `max_step_tokens` (64, or the stage's largest step if that is more) and any attended cache
width; each layer's part of the cache's tensors (K/V, and a hybrid's DeltaNet states, conv windows
and step factors) is an input of its own that it updates in place (see KVCache.tensors).
Packages do not check their input shapes, so the loaded stage feeds prompts in chunks of at most
`max_step_tokens`.
`specgraph run --program DIR` loads the packages and runs them without recompiling. The
manifest's `key` hashes every recipe field, the library versions and specgraph's source:
`compile` into a folder whose key matches does nothing, a mismatch is logged with its reason
before recompiling, and `run --program` refuses a folder compiled by other code or libraries.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
import triton
from torch import nn
from torch.export import Dim

from specgraph.cache import KVCache
from specgraph.errors import SpecgraphError
from specgraph.files import check_output, read_json, write_output
from specgraph.kernels import Kernels
from specgraph.layout import Layout
from specgraph.models.hybrid import HybridModel, HybridShape
from specgraph.models.llama import LlamaShape
from specgraph.models.loader import DTYPES
from specgraph.recipe import Recipe

MAX_STEP_TOKENS = 64


def _log(message: str) -> None:
    print(f"specgraph: {message}", file=sys.stderr)


@functools.cache
def versions() -> dict[str, str]:
    """What a compiled program depends on besides its recipe: a hash of specgraph's own source (so
    that a program compiled by other code is never reused, installed or run from a checkout) and
    the libraries' versions; read once per process (do not modify the result)."""
    package = Path(__file__).resolve().parent
    source = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        source.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return {"specgraph_source": source.hexdigest()[:16], "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__}


def program_key(recipe: Recipe) -> str:
    text = json.dumps({"recipe": recipe.model_dump(mode="json"), "versions": versions()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class _StepModule(nn.Module):
    """A stage's forward with its layout and cache as plain tensor inputs (what torch.export takes)."""

    def __init__(self, model: nn.Module, cache_type: type[KVCache], block_size: int):
        super().__init__()
        self.model, self.cache_type, self.block_size = model, cache_type, block_size

    def forward(self, tokens, slots, positions, rows, cu, starts, visible, grid, table,
                cache: tuple[tuple[torch.Tensor, ...], ...]):
        layout = Layout(tokens.shape[1], slots, positions, rows, cu, starts, visible, grid, table, self.block_size)
        return self.model(tokens, self.cache_type.wrap(*cache), layout)


def _inputs(layout: Layout) -> tuple[torch.Tensor, ...]:
    """A layout as a package's inputs after the tokens (see _StepModule)."""
    return (layout.slots, layout.positions, layout.rows, layout.cu, layout.starts, layout.visible, layout.grid,
            layout.table.contiguous())  # (the layout's is a view of the stage's: its strides would be guarded)


def closed_form_commits(graph):
    """A package's gated-DeltaNet step is the closed form (the reference, traced), so its cache's
    commit must be the closed form's too: where the plan chose the walk (auto on a GPU), the
    closed-form Triton kernels instead (the pair's step_decay means G, not g)."""
    for name in graph.stages():
        kernels = graph.node(name)["kernels"]
        if kernels["gated_delta_commit"] == "invariant":
            kernels.update(gated_delta_step="triton", gated_delta_commit="triton")
    return graph


class ExportedModel:
    """A loaded package with the model interface a Stage uses."""

    def __init__(self, package: Path, shape: LlamaShape | HybridShape, served_vocab: int, dtype: torch.dtype,
                 device: torch.device, max_step_tokens: int):
        self.runner = torch._inductor.aoti_load_package(str(package))
        self.shape, self.served_vocab, self.dtype, self.device = shape, served_vocab, dtype, device
        self.max_step_tokens = max_step_tokens

    def new_cache(self, blocks: int, block_size: int, requests: int = 1, kernels: Kernels = Kernels()) -> KVCache:
        cache = self.shape.new_cache(blocks, block_size, requests, self.dtype, self.device, kernels)
        cache.max_step_tokens = min(cache.max_step_tokens, self.max_step_tokens)  # the package's T range per request
        return cache

    def __call__(self, tokens, cache: KVCache, layout: Layout, logits: bool = True) -> torch.Tensor | None:
        """The package's forward (traced with its vocabulary projection, which it always runs: a prompt
        forward's `logits=False` only drops them)."""
        projected = self.runner(tokens, *_inputs(layout), cache.tensors())
        return projected if logits else None


def _first_difference(old, new, where: str = "") -> str | None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            found = _first_difference(old.get(key), new.get(key), f"{where}.{key}" if where else str(key))
            if found:
                return found
        return None
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return next((d for i, (a, b) in enumerate(zip(old, new)) if (d := _first_difference(a, b, f"{where}.{i}"))), None)
    return None if old == new else where or "recipe"


MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
               "merges.txt", "tokenizer.model", "special_tokens_map.json")  # what a program needs of a checkpoint


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _digest(manifest: dict) -> str:
    """The hash of a manifest's content (all but its `digest`): an edit shows."""
    return hashlib.sha256(json.dumps({k: v for k, v in manifest.items() if k != "digest"}, sort_keys=True).encode()).hexdigest()


def check_program_folder(out: Path) -> dict | None:
    """The folder's manifest if it is a program folder of ours; refuse a file, or a folder holding
    anything else (nothing of the user's is ever overwritten), or a place where the folder cannot be
    made or written (tried, as for any output: where its manifest or its first missing folder goes)."""
    if out.exists() and not out.is_dir():
        raise SpecgraphError(f"-o: {out} is a file; give a folder for the program")
    first = out / "manifest.json"
    while not first.parent.exists():
        first = first.parent
    check_output(first, "-o")
    if not out.is_dir() or not any(out.iterdir()):
        return None
    manifest_path = out / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        if isinstance(manifest, dict) and manifest.get("digest") == _digest(manifest):
            return manifest
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        pass
    raise SpecgraphError(f"-o: {out} holds files that are not a specgraph program of this version; "
                         "give an empty or new folder")


def check_exportable(graph) -> None:
    """Refuse, in one line, a planned program that cannot be exported (before any model loads)."""
    heads = [name for name in graph.stages() if graph.node(name)["features"] is not None]
    if heads:
        raise SpecgraphError(f"compile: stage {heads[0]} drafts with an EAGLE-3 head, which cannot be exported yet; "
                             "run the recipe itself (specgraph run RECIPE)")
    if graph.recipe.lowering.row_invariant:
        raise SpecgraphError("lowering.row_invariant: an exported program runs AOTInductor's code for plain PyTorch "
                             "ops, whose rows are not invariant; run the recipe itself (specgraph run RECIPE)")


def export_program(program, out: Path) -> dict:
    """Write one package per stage of the lowered `program`, the configs and tokenizers its models
    need (models/NAME/), and the manifest with a hash of each file and of itself; reuse an
    up-to-date folder. The folder is then all `run --program` needs, from any working folder."""
    out = Path(out)
    recipe = program.recipe
    check_exportable(program.graph)
    key = program_key(recipe)
    old = check_program_folder(out)
    if old is not None:
        intact = all((out / f).is_file() and _sha256(out / f) == h for f, h in old.get("files", {}).items())
        if old.get("key") == key and intact:
            _log(f"{out}: compiled program is up to date (key {key[:12]})")
            return old
        reason = (_first_difference(old.get("recipe"), recipe.model_dump(mode="json"))
                  or _first_difference(old.get("versions"), versions()) or "a damaged file")
        _log(f"{out}: recompiling: {reason} changed")
    out.mkdir(parents=True, exist_ok=True)
    for name, model in recipe.models.items():
        folder = out / "models" / name
        folder.mkdir(parents=True, exist_ok=True)
        for file in MODEL_FILES:
            if (model.path / file).is_file():
                shutil.copyfile(model.path / file, folder / file)
    stages = {}
    for name, stage in program.stages.items():
        stage.model.use_kernels(Kernels())  # AOTInductor compiles the plain-PyTorch ops (ours are Python custom ops)
        node = program.graph.node(name)
        step_tokens = max(MAX_STEP_TOKENS, node["step_tokens"])
        requests = stage.table.shape[0]
        t, r = Dim("t", min=1, max=requests * step_tokens), Dim("r", min=1, max=requests)
        g, m = Dim("g", min=1, max=step_tokens), Dim("m", min=1, max=stage.table.shape[1])
        cache = stage.cache.tensors()
        example = Layout.build(stage.table, stage.block_size, torch.arange(2, device=stage.device),
                               torch.tensor([3, 5], device=stage.device), torch.tensor([2, 2], device=stage.device),
                               torch.tensor([0, 1, 0, 1], device=stage.device),
                               torch.ones(4, 3, dtype=torch.bool, device=stage.device).tril(),
                               torch.arange(4, device=stage.device), 2 * stage.block_size)
        inputs = (torch.zeros(1, 4, dtype=torch.long, device=stage.device), *_inputs(example), cache)
        dims = ({1: t}, {0: t}, {0: t}, {0: r}, {0: r + 1}, {0: r}, {0: t, 1: g}, {0: r, 1: g}, {1: m},
                tuple(tuple(None for _ in layers) for layers in cache))
        _log(f"exporting stage {name} (up to {step_tokens} tokens of {requests} requests, {stage.capacity} slots each)")
        exported = torch.export.export(_StepModule(stage.model, type(stage.cache), stage.block_size), inputs,
                                       dynamic_shapes=dims)
        _log(f"compiling stage {name} with AOTInductor")
        package = f"{name}.pt2"
        torch._inductor.aoti_compile_and_package(exported, package_path=str(out / package))
        stages[name] = {"package": package, "max_step_tokens": step_tokens,
                        "hybrid": isinstance(stage.model, HybridModel), "shape": dataclasses.asdict(stage.model.shape),
                        "served_vocab": stage.model.served_vocab, "dtype": str(stage.cache.k.dtype).removeprefix("torch."),
                        "device": str(stage.device), "verifies": program.graph.drafter_of(name),
                        "tree_nodes": node["tree_nodes"], "cache_slots": node["cache_slots"],
                        "graph_buckets": list(node["graph_buckets"]), "step_graphs": node["step_graphs"]}
    files = {p.relative_to(out).as_posix(): _sha256(p) for p in sorted(out.rglob("*"))
             if p.is_file() and p.name != "manifest.json"}
    manifest = {"key": key, "versions": versions(), "recipe": recipe.model_dump(mode="json"), "stages": stages,
                "files": files}
    manifest["digest"] = _digest(manifest)
    write_output(out / "manifest.json", json.dumps(manifest, indent=1))
    _log(f"wrote {out} ({', '.join(stages)})")
    return manifest


def load_program(folder: Path):
    """The Program of a compiled folder: its recipe, its models' configs and tokenizers from the
    folder, each stage running its package. Everything is checked before anything is loaded: the
    library versions, the manifest against its digest, each file against its hash."""
    from specgraph.passes import plan
    from specgraph.program import Program

    folder = Path(folder)
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise SpecgraphError(f"--program: {folder} has no manifest.json; make one with specgraph compile RECIPE -o {folder}")
    manifest = read_json(manifest_path, "--program")
    if not isinstance(manifest, dict):
        raise SpecgraphError(f"--program: {manifest_path} is not a specgraph manifest; compile the recipe again")
    compiled_with = manifest.get("versions") or {}
    changed = _first_difference(compiled_with, versions())
    if changed is not None:
        raise SpecgraphError(f"--program: {folder} was compiled with another {changed} "
                             f"({compiled_with.get(changed)}, here {versions()[changed]}); compile it again")
    missing = [k for k in ("key", "recipe", "stages", "files", "digest") if k not in manifest]
    if missing:
        raise SpecgraphError(f"--program: {manifest_path} lacks '{missing[0]}'; compile the recipe again")
    if manifest["digest"] != _digest(manifest):
        raise SpecgraphError(f"--program: {manifest_path} was edited (it no longer matches its digest); "
                             "compile the recipe again")
    for file, expected in manifest["files"].items():
        path = folder / file
        if not path.is_file():
            raise SpecgraphError(f"--program: {path} is missing; compile the recipe again")
        if _sha256(path) != expected:
            raise SpecgraphError(f"--program: {path} was changed or damaged (its hash differs from the manifest's); "
                                 "compile the recipe again")
    data = manifest["recipe"]
    data = {**data, "models": {name: {**spec, "path": str(folder.resolve() / "models" / name)}
                               for name, spec in data["models"].items()}}
    recipe = Recipe.from_dict(data)
    recipe = recipe.model_copy(update={"lowering": recipe.lowering.model_copy(update={"compile": False})})
    graph = closed_form_commits(plan(recipe))
    models = {}
    for name, entry in manifest["stages"].items():
        shape = {k: tuple(v) if isinstance(v, list) else v for k, v in entry["shape"].items()}  # (JSON has no tuples)
        shape = HybridShape(**shape) if entry["hybrid"] else LlamaShape(**shape)
        models[name] = ExportedModel(folder / entry["package"], shape, entry["served_vocab"], DTYPES[entry["dtype"]],
                                     torch.device(entry["device"]), entry["max_step_tokens"])
    return Program(graph, models)

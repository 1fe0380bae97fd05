"""specgraph command line: run | bench | compile | export | inspect | tune | report | serve | loadgen."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
import warnings
from pathlib import Path

from specgraph.errors import RecipeWarning, SpecgraphError
from specgraph.stack import on_a_stack_chunk_of_its_own

TUNE_NEW_TOKENS, BOLE_EPSILON = 64, 0.1  # tune's defaults: new tokens per prompt, bole's budget
DEFAULT_BASELINES = "hf,hf-assisted,ar"  # bench's (with --batch: ar,hf)


def _recipe_args(parser: argparse.ArgumentParser, optional: bool = False, help: str = "recipe YAML file",
                 metavar: str = "RECIPE") -> None:
    parser.add_argument("recipe", type=Path, help=help, metavar=metavar, nargs="?" if optional else None)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe field by dotted path, e.g. stages.0.devices=[cpu] (repeatable)")


def _prompt_args(parser: argparse.ArgumentParser, new_tokens: str = "override the recipe's max_new_tokens") -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompts", type=Path, metavar="FILE.jsonl",
                        help="JSON lines with 'prompt' (text) and optional 'id'")
    parser.add_argument("--max-new-tokens", type=int, help=new_tokens)
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="launch every forward's kernels one by one (GPU; same as --set lowering.cuda_graphs=false)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile each stage's step functions: decoder layers, stem and head, and the "
                             "target's work around its forward (default: on GPUs, not on the CPU; "
                             "same as --set lowering.compile=true|false)")


WIDEN = dict(metavar="SHAPE[:SCHEME]", help="widen the target to a real model's shape (llama-3-8b, llama-3-70b, "
             "qwen3.5-9b, ...) and the drafter to the small shape with its head dim; same function, real size; "
             ":w4a16, :w8a16 or :fp8 quantizes their projections as `specgraph quantize` does, layer by layer")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specgraph", description="graph-compiled speculative decoding")
    common = argparse.ArgumentParser(add_help=False)  # every command's
    common.add_argument("--debug", action="store_true", help="print the traceback of an error too (or SPECGRAPH_DEBUG=1)")
    common.add_argument("--threads", type=int, metavar="N",
                        help="CPU threads (default: the cores that other processes leave free, at least one)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser = functools.partial(sub.add_parser, parents=[common])

    run = sub.add_parser("run", help="decode prompts with a recipe (or a compiled program)")
    _recipe_args(run, optional=True)
    run.add_argument("--program", type=Path, metavar="DIR", help="run the packages of `specgraph compile` instead")
    _prompt_args(run)
    run.add_argument("--json", type=Path, metavar="OUT", help="write results and summary as JSON")
    run.add_argument("--batch", type=int, metavar="N", help="decode up to N prompts at once (serial recipes; same as "
                     "--set serving.max_batch=N; default: the recipe's, 1)")

    bench = sub.add_parser("bench", help="measure the recipe against baselines in one run")
    _recipe_args(bench)
    _prompt_args(bench)
    bench.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts (default 3)")
    bench.add_argument("--warmup", type=int, metavar="N", help="decode only the first N prompts in the untimed first "
                       "pass, where compilation and graph capture happen (default: all); specgraph's decoding after "
                       "the first token is timed apart from prefill, so shapes it first meets later add only to TTFT "
                       "(transformers' compiled baselines may recompile inside their timed decoding)")
    bench.add_argument("--baselines", default=DEFAULT_BASELINES,
                       help="comma-separated: hf, hf-assisted, ar, serial, or a recipe file (.yaml) that differs "
                       "from the recipe only in its stages' trees, run over the same loaded models (a tuned recipe "
                       "against the hand-written one); default hf,hf-assisted,ar")
    bench.add_argument("--widen", **WIDEN)
    bench.add_argument("--batch", dest="batches", metavar="N,N,...",
                       help="measure many requests at once: for each batch size, every prompt decoded with at most N "
                            "in flight, by the recipe, ar and hf (--baselines ar,hf; also `always`: every step "
                            "speculating, and `epsilon=E`: the recipe's budget at epsilon E); e.g. 1,4,16 (serial recipes)")
    bench.add_argument("--json", type=Path, metavar="OUT", help="write the report as JSON")
    bench.add_argument("--plot", type=Path, metavar="OUT.png", help="plot tokens/s per system and accepted lengths, "
                       "in the format the suffix names (.png, .jpg, .pdf, .svg, ...)")

    for name, text in (("compile", "lower the recipe to exported step programs (torch.export + AOTInductor)"),
                       ("export", "the same as compile, for those who only want the packages")):
        command = sub.add_parser(name, help=text)
        _recipe_args(command)
        command.add_argument("-o", "--output", type=Path, required=True, metavar="DIR", help="folder for packages")

    inspect = sub.add_parser("inspect", help="print the graph and the plan after each pass")
    _recipe_args(inspect)
    inspect.add_argument("--dot", type=Path, metavar="OUT", help="write the planned graph as Graphviz DOT")

    tune = sub.add_parser("tune", help="measure verification cost and acceptance here; write the recipe with the "
                                       "draft tree they favour")
    _recipe_args(tune)
    _prompt_args(tune, f"new tokens per prompt while measuring acceptance (default {TUNE_NEW_TOKENS})")
    tune.add_argument("-o", "--output", type=Path, required=True, metavar="TUNED.yaml",
                      help="the recipe with the chosen tree on its drafting stage")
    tune.add_argument("--rule", choices=("throughput", "bole"), default="throughput",
                      help="throughput: the highest expected tokens/s (default); bole: the largest tree whose "
                           "verification costs at most (1 + epsilon) one-token forwards")
    tune.add_argument("--epsilon", type=float, help=f"bole's budget (default {BOLE_EPSILON})")
    tune.add_argument("--max-prompts", type=int, default=8, help="prompts of the file used (default 8)")
    tune.add_argument("--max-nodes", type=int, default=64, help="most draft nodes of a candidate tree (default 64)")
    tune.add_argument("--widths", default="1,2,4", help="candidate widths, comma-separated (default 1,2,4)")
    tune.add_argument("--depths", default="2,3,4,6", help="candidate depths (default 2,3,4,6)")
    tune.add_argument("--nodes", default="4,8,16,32,64",
                      help="candidate node counts, each cut to what the width and depth grow (default 4,8,16,32,64)")
    tune.add_argument("--widen", **WIDEN)

    serve = sub.add_parser("serve", help="serve a recipe, or a model (with a drafter: --draft), over HTTP with the "
                                         "OpenAI API (completions, chat, streaming), until Ctrl-C or SIGTERM")
    _recipe_args(serve, help="a recipe YAML file, or a model to serve: a checkpoint folder or a Hugging Face hub id "
                 "(org/name) in the local cache", metavar="RECIPE|MODEL")
    serve.add_argument("--draft", "--speculative-model", dest="draft", metavar="MODEL", help="with a MODEL: a "
                       "drafter for it (a checkpoint folder or hub id), drafting the default tree (a chain of 4)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                       "only; 0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free one, "
                       "printed)")
    serve.add_argument("--batch", type=int, metavar="N", help="decode up to N requests at once (serial recipes; same "
                       "as --set serving.max_batch=N; default: the recipe's, 1)")
    serve.add_argument("--chat-template", type=Path, metavar="FILE", help="a Jinja chat template for "
                       "/v1/chat/completions, as transformers applies it (default: the tokenizer's own)")
    serve.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1 requests")
    serve.add_argument("--grace", type=float, metavar="SECONDS", help="after SIGTERM or Ctrl-C, seconds "
                       "the requests in flight get to finish before they are cancelled (default 5)")
    serve.add_argument("--widen", **WIDEN)
    serve.set_defaults(compile=None, cuda_graphs=True)

    loadgen = sub.add_parser("loadgen", help="measure an OpenAI-compatible completions server under load: streamed "
                                             "requests at a rate or a concurrency; latency and throughput")
    loadgen.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8000 (its /v1/completions is "
                         "requested)")
    loadgen.add_argument("--prompts", type=Path, required=True, metavar="FILE.jsonl",
                         help="JSON lines with 'prompt' (text) and optional 'id'; taken in turn")
    loadgen.add_argument("--requests", type=int, required=True, metavar="N", help="requests to send")
    pace = loadgen.add_mutually_exclusive_group()
    pace.add_argument("--rate", type=float, metavar="R", help="Poisson arrivals at R requests/s (default: all at once)")
    pace.add_argument("--concurrency", type=int, metavar="C", help="keep C requests in flight")
    loadgen.add_argument("--max-tokens", type=int, default=128, metavar="M", help="max_tokens of each request "
                         "(default 128)")
    loadgen.add_argument("--model", help="the model to ask for (default: the server's first, from /v1/models)")
    loadgen.add_argument("--api-key", metavar="KEY", help="send 'Authorization: Bearer KEY'")
    loadgen.add_argument("--json", type=Path, metavar="OUT", help="write the report and every request's figures as "
                         "JSON")
    loadgen.add_argument("--plot", type=Path, metavar="OUT.png", help="plot the latency distributions, in the "
                         "format the suffix names (.png, .jpg, .pdf, .svg, ...)")
    loadgen.add_argument("--allow-remote", action="store_true", help="send load to a URL that is not on this machine")
    loadgen.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default 0)")

    report = sub.add_parser("report", help="print bench reports (--json) of the same systems on parts of a prompt "
                                           "file, merged into one (a `bench --batch` report alone, as it is)")
    report.add_argument("parts", type=Path, nargs="+", metavar="PART.json", help="`specgraph bench --json` reports")
    report.add_argument("--json", type=Path, metavar="OUT", help="write the merged report as JSON")
    report.add_argument("--plot", type=Path, metavar="OUT.png", help="plot tokens/s per system and accepted lengths, "
                       "in the format the suffix names (.png, .jpg, .pdf, .svg, ...)")

    quantize = sub.add_parser("quantize", help="quantize a checkpoint's projections (round to nearest) and write "
                              "it in compressed-tensors' format, which transformers and vLLM load")
    quantize.add_argument("source", type=Path, metavar="SRC", help="the checkpoint folder")
    quantize.add_argument("-o", "--output", type=Path, required=True, metavar="OUT", help="a new folder for the result")
    quantize.add_argument("--scheme", choices=["w4a16", "w8a16", "fp8"], required=True,
                          help="int4 or int8 weights (symmetric) or fp8 weights, activations left as they are")
    quantize.add_argument("--group-size", type=int, metavar="G", help="weights per scale along the inputs (default: "
                          "128 for w4a16, one scale per output row for w8a16; fp8: always per row)")
    quantize.add_argument("--method", choices=["rtn", "awq"], default="rtn", help="how weights are scaled before "
                          "rounding: rtn, round to nearest over each group's range (default); awq, activation-aware "
                          "scales and clips searched on --calibration prompts")
    quantize.add_argument("--calibration", type=Path, metavar="PROMPTS.jsonl", help="awq: prompts ({\"prompt\": "
                          "TEXT} per line) like those the model will serve")
    quantize.add_argument("--device", help="awq: where the calibration runs (default: cuda if there is a GPU, else "
                          "cpu); the model must fit there")
    train = sub.add_parser("train-draft", help="train an EAGLE-3 head for a Llama-family target (resumable; writes "
                                               "the published layout, which a recipe names as its draft model)")
    train.add_argument("target", type=Path, metavar="TARGET", help="the target's checkpoint folder")
    train.add_argument("--data", type=Path, required=True, metavar="FILE.jsonl",
                       help="JSON lines with a 'text' (or 'prompt') field")
    train.add_argument("-o", "--output", type=Path, required=True, metavar="OUT",
                       help="the head's folder (resumed where it holds an unfinished run)")
    train.add_argument("--steps", type=int, default=1000, help="optimizer steps in all (default 1000)")
    train.add_argument("--layers", metavar="L1,L2,L3", help="the target layers whose inputs the head reads "
                       "(default: 2, L/2, L-3)")
    train.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (default 1e-3)")
    train.add_argument("--batch", type=int, default=8, help="windows per step (default 8)")
    train.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    train.add_argument("--ttt", type=int, default=5, help="rounds of the training-time test: the deepest tree's "
                       "depth at least (default 5)")
    train.add_argument("--decay-steps", type=int, help="after the warm-up, a cosine from --lr to a tenth of it by this "
                       "step (default: none, --lr throughout)")
    train.add_argument("--init", type=Path, metavar="HEAD", help="start from this head's weights (its vocabulary, "
                       "layers and MLP width) instead of random ones")
    train.add_argument("--draft-vocab", type=int, help="the head's vocabulary: the data's most frequent tokens, at "
                       "most the target's vocabulary (default: 32000 or the target's, whichever is fewer)")
    train.add_argument("--intermediate-size", type=int, help="the head's MLP width (default: the target's)")
    train.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                       help="of the weights written (default float32)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--device", default="cpu", help="where to train (default cpu)")
    return parser


def read_prompts(args: argparse.Namespace, default: str | None) -> list[dict]:
    if args.prompt is not None:
        return [{"id": "000", "prompt": _text_argument(args.prompt, "--prompt")}]
    if args.prompts is None:
        if default is None:
            raise SpecgraphError("no prompt: give --prompt TEXT or --prompts FILE.jsonl, or set 'prompt' in the recipe")
        return [{"id": "000", "prompt": default}]
    return read_prompt_file(args.prompts, "--prompts")


def _text_argument(text: str, flag: str) -> str:
    """A command-line argument as text, refused in one line where it is empty, or not UTF-8 (Python
    hands over such bytes as lone surrogates, U+DC80-U+DCFF, which no tokenizer takes)."""
    if not text:
        raise SpecgraphError(f"{flag}: empty; give the text to continue (a prompt needs at least one token)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = ord(text[exc.start]) - 0xDC00 if 0xDC80 <= ord(text[exc.start]) <= 0xDCFF else None
        shown = f"byte 0x{byte:02x}" if byte is not None else f"U+{ord(text[exc.start]):04X}"
        raise SpecgraphError(f"{flag}: not UTF-8 text ({shown} at character {exc.start}); give UTF-8 text") from None
    return text


def read_prompt_file(path: Path, flag: str) -> list[dict]:
    """The prompts of a JSONL file ({"prompt": TEXT[, "id": ID]} per line), named by the command's
    `flag` in its one-line errors."""
    from specgraph.files import read_text

    prompts, lines = [], {}  # id -> the line that gave it
    for n, line in enumerate(read_text(path, flag).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecgraphError(f"{flag}: {path} line {n} is not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise SpecgraphError(f"{flag}: {path} line {n} needs a 'prompt' string")
        given = row.get("id")
        if given is not None and not isinstance(given, (str, int)) or isinstance(given, bool):
            raise SpecgraphError(f"{flag}: {path} line {n}: 'id' must be a string or a whole number (got "
                                 f"{json.dumps(given)}); leave it out to number the prompt")
        prompt_id = f"{len(prompts):03d}" if given is None else str(given)
        if prompt_id in lines:
            raise SpecgraphError(f"{flag}: {path} line {n}: id {prompt_id!r} is line {lines[prompt_id]}'s "
                                 "too; give every prompt its own id (or none: its number)")
        lines[prompt_id] = n
        prompts.append({"id": prompt_id, "prompt": row["prompt"]})
    if not prompts:
        raise SpecgraphError(f"{flag}: {path} holds no prompts")
    return prompts


def _overrides(args: argparse.Namespace) -> list[str]:
    """The command's --set, its lowering flags and --batch, as recipe overrides."""
    lowering = [f"lowering.compile={str(args.compile).lower()}"] if args.compile is not None else []
    batch = [f"serving.max_batch={args.batch}"] if getattr(args, "batch", None) is not None else []
    return [*args.overrides, *lowering, *([] if args.cuda_graphs else ["lowering.cuda_graphs=false"]), *batch]


def _anchored(overrides: list[str], folder: Path) -> list[str]:
    """`overrides` with relative model paths (`models.NAME.path=...`) joined to `folder`, so that
    they name the same checkpoint in a recipe file elsewhere."""
    anchored = []
    for override in overrides:
        key, sep, value = override.partition("=")
        parts = key.strip().split(".")
        if len(parts) == 3 and parts[0] == "models" and parts[2] == "path" and value and not Path(value).is_absolute():
            override = f"{key}{sep}{folder / value}"
        anchored.append(override)
    return anchored


def _load_recipe(args: argparse.Namespace):
    from specgraph.recipe import Recipe

    recipe = Recipe.from_yaml(args.recipe, _overrides(args))
    return recipe, read_prompts(args, recipe.prompt)


def cmd_run(args: argparse.Namespace) -> int:
    """Decode every prompt, keeping what finished: a prompt that cannot be decoded is reported and
    skipped, and a stop (Ctrl-C, or the program's processes failing) still writes the JSON of the
    prompts done before it."""
    from tqdm import tqdm

    from specgraph.errors import PromptError
    from specgraph.export import load_program
    from specgraph.files import check_output
    from specgraph.passes import plan
    from specgraph.passes.place import world_size
    from specgraph.program import Program

    if args.json is not None:
        check_output(args.json, "--json")
    started = time.perf_counter()
    if args.program is not None:
        if args.recipe is not None:
            raise SpecgraphError("--program: give a compiled folder or a recipe, not both")
        if args.batch is not None:
            raise SpecgraphError("--batch: a compiled program decodes as many requests at once as its recipe's "
                                 "serving.max_batch; compile with --set serving.max_batch=N")
        if args.compile is not None or not args.cuda_graphs:
            raise SpecgraphError("--compile/--no-cuda-graphs: a compiled program is lowered already; compile again "
                                 "with --set lowering.compile=... or lowering.cuda_graphs=false")
        if args.overrides:
            raise SpecgraphError("--set: a compiled program runs the recipe it was compiled from; compile again "
                                 "with the change (`specgraph compile RECIPE --set KEY=VALUE -o DIR`)")
        program = load_program(args.program)
        recipe = program.recipe
        prompts = read_prompts(args, recipe.prompt)
    else:
        if args.recipe is None:
            raise SpecgraphError("run: give a RECIPE file or --program DIR")
        recipe, prompts = _load_recipe(args)
        if args.batch is not None and args.batch > 1 and recipe.execution != "serial":
            raise SpecgraphError(f"--batch: execution {recipe.execution!r} decodes one request at a time; give --batch 1, "
                                 "or a serial recipe")
        print(f"specgraph: loading {recipe.name} ({', '.join(s.name for s in recipe.stages)})", file=sys.stderr)
        graph = plan(recipe)
        if world_size(graph) > 1 and recipe.serving.max_batch > 1:
            raise SpecgraphError(f"--batch: recipe {recipe.name} runs over several processes (split stages), which "
                                 "decode one request at a time; give --batch 1, or each stage one device")
        program = Program(graph)
        if any(program.graph.node(name)["compile"] for name in program.graph.stages()):
            print("specgraph: step functions compile with torch.compile during the first steps "
                  "(--no-compile skips it)", file=sys.stderr)
    done, errors, stop = {}, [], {}  # prompt index -> its result, as each finishes
    began = time.perf_counter()
    try:
        with program:
            encoded = [program.encode(row["prompt"]) for row in prompts]
            began = time.perf_counter()
            # (a bar redrawn in place: only where a terminal shows it, not in a log's lines)
            with tqdm(total=len(prompts), desc="prompts", unit="prompt", file=sys.stderr,
                      disable=len(prompts) == 1 or not sys.stderr.isatty()) as bar:
                for index, gen in program.generate_many(encoded, args.max_new_tokens):
                    row = prompts[index]
                    if isinstance(gen, PromptError):
                        if len(prompts) > 1:  # (one prompt: its error ends the command, below)
                            bar.write(f"specgraph: error: prompt {row['id']}: {gen}; skipped", file=sys.stderr)
                        errors.append((index, {"id": row["id"], "error": str(gen)}))
                    else:
                        done[index] = {"id": row["id"], "prompt_tokens": len(encoded[index]),
                                       "output_ids": gen.output_ids, "text": program.decode(gen.output_ids),
                                       "target_steps": gen.target_steps, "accepted_lengths": gen.accepted_lengths,
                                       "wall_seconds": gen.seconds, "first_seconds": gen.first_token_seconds,
                                       "finish_reason": gen.finish_reason,
                                       # the executor's own measurements (per stage, for a pipeline)
                                       **({"stats": gen.stats} if gen.stats else {}),
                                       **({"clipped": True} if gen.clipped else {})}
                        if gen.clipped:
                            bar.write(f"specgraph: note: prompt {row['id']}: max_seq_len {recipe.max_seq_len} cut it "
                                      f"to {len(gen.output_ids)} new tokens", file=sys.stderr)
                    bar.update()  # (after the prompt is kept: what the bar counts, a Ctrl-C still writes)
    except KeyboardInterrupt:
        stop = {"interrupted": True}
        raise
    except SpecgraphError as exc:
        stop = {"failed": str(exc)}
        raise
    finally:  # also on Ctrl-C or a failed process: what finished is kept (in file order), marked as cut short
        errors = [error for _, error in sorted(errors, key=lambda e: e[0])]
        _report_run(args, recipe.name, prompts, [done[i] for i in sorted(done)], errors, stop,
                    time.perf_counter() - began, began - started)
    if errors and len(prompts) == 1:
        where = ("--prompt" if args.prompt is not None else f"--prompts: prompt {errors[0]['id']}"
                 if args.prompts is not None else "the recipe's prompt")
        raise SpecgraphError(f"{where}: {errors[0]['error']}")
    if errors:
        raise SpecgraphError(f"{len(errors)} of {len(prompts)} prompts could not be decoded and were skipped (each "
                             "named above)")
    return 0


def _report_run(args: argparse.Namespace, name: str, prompts: list[dict], results: list[dict], errors: list[dict],
                stop: dict, wall: float, build: float) -> None:
    """The summary line, the completion of a single prompt, and the --json report (`stop`: how the run
    was cut short, {} if it was not: {"interrupted": true} for Ctrl-C, {"failed": why} for a fault;
    `wall`: the seconds the prompts took, from the first one in to the last one out; `build`: those
    before, loading and building the program)."""
    from specgraph.bench.pipespec import stage_table
    from specgraph.files import write_output
    from specgraph.runtime.executor import total_stats

    steps = [n for r in results for n in r["accepted_lengths"]]
    new_tokens = sum(len(r["output_ids"]) for r in results)
    for r in results:
        r.pop("wall_seconds")
    firsts = [r.pop("first_seconds") for r in results]  # prefill; compilation and capture happen in the first steps
    summary = {"new_tokens": new_tokens, "wall_seconds": round(wall, 4), "build_seconds": round(build, 2),
               "tokens_per_second": round(new_tokens / wall, 2) if wall > 0 else 0.0,
               "mean_accepted_length": round(sum(steps) / len(steps), 3) if steps else 0.0}
    pipeline = stage_table(total_stats(r.get("stats", {}) for r in results))
    if pipeline is not None:
        summary["pipeline"] = pipeline
    if len(prompts) == 1 and results:
        print(prompts[0]["prompt"] + results[0]["text"])  # (under --json -, to standard error: files.data_on_stdout)
    if results:
        done = "" if len(results) == len(prompts) else f" ({len(results)} of {len(prompts)} prompts)"
        first = (f"{firsts[0]:.2f} s to the first token, prefill and any compilation included" if len(firsts) == 1
                 else f"on average {sum(firsts) / len(firsts):.2f} s from the start to a request's first token, its "
                 "wait behind earlier prompts, prefill and any compilation included")
        print(f"specgraph: {summary['new_tokens']} new tokens in {summary['wall_seconds']:.2f} s{done}, after a "
              f"{build:.1f} s build ({first}): "
              f"{summary['tokens_per_second']:.1f} tokens/s, mean accepted length {summary['mean_accepted_length']:.2f}",
              file=sys.stderr)
    if args.json is not None:
        report = {"recipe": name, "results": results, "summary": summary} | ({"errors": errors} if errors else {}) | stop
        write_output(args.json, json.dumps(report, indent=1))


def _check_report_outputs(args: argparse.Namespace) -> None:
    """Before any work: the --json and --plot paths of bench and report can be written, and the
    plot's suffix names an image format."""
    from specgraph.bench.report import plot_format
    from specgraph.files import check_output

    for path, flag in ((args.json, "--json"), (args.plot, "--plot")):
        if path is not None:
            check_output(path, flag)
    if args.plot is not None:
        plot_format(args.plot)


def _present_report(report: dict, args: argparse.Namespace) -> None:
    """A bench report's table on the terminal, and its JSON and plot where asked."""
    from specgraph.bench.report import plot, print_table
    from specgraph.files import write_output

    print_table(report)
    if args.json is not None:
        write_output(args.json, json.dumps(report, indent=1))
    if args.plot is not None:
        plot(report, args.plot)


def cmd_bench(args: argparse.Namespace) -> None:
    from specgraph.bench.harness import BenchSpec, run_bench

    _check_report_outputs(args)
    recipe, prompts = _load_recipe(args)
    if args.batches is not None:
        return _bench_batches(args, recipe, prompts)
    if args.repeats < 1:
        raise SpecgraphError(f"--repeats: must be at least 1 (got {args.repeats})")
    if args.warmup is not None and args.warmup < 1:
        raise SpecgraphError(f"--warmup: must be at least 1 prompt (got {args.warmup}); leave it out to warm up on all")
    spec = BenchSpec(recipe, prompts, args.max_new_tokens or recipe.max_new_tokens, args.repeats,
                     tuple(b.strip() for b in args.baselines.split(",") if b.strip()), args.widen, args.warmup,
                     tuple(_anchored(_overrides(args), args.recipe.parent)))
    _present_report(run_bench(spec), args)


def _bench_batches(args: argparse.Namespace, recipe, prompts: list[dict]) -> None:
    """bench --batch: each batch size measured (bench/batched.py)."""
    from specgraph.bench.batched import BatchSpec, run_batched_bench

    batches = _whole_numbers(args.batches, "--batch")
    baselines = args.baselines if args.baselines != DEFAULT_BASELINES else "ar,hf"
    max_new_tokens = args.max_new_tokens or recipe.max_new_tokens
    report = run_batched_bench(BatchSpec(recipe, prompts, max_new_tokens, sorted(set(batches)),
                                         tuple(b.strip() for b in baselines.split(",") if b.strip()), args.widen))
    _present_batched(report, args)


def _present_batched(report: dict, args: argparse.Namespace) -> None:
    """A `bench --batch` report's table on the terminal, and its JSON and plot where asked."""
    from specgraph.bench.batched import plot_batched, print_batched
    from specgraph.files import write_output

    print_batched(report)
    if args.json is not None:
        write_output(args.json, json.dumps(report, indent=1))
    if args.plot is not None:
        plot_batched(report, args.plot)


def cmd_report(args: argparse.Namespace) -> None:
    from specgraph.bench.merge import merge_reports
    from specgraph.files import read_json

    _check_report_outputs(args)
    seen = set()
    for path in args.parts:
        if path.resolve() in seen:
            raise SpecgraphError(f"report: {path} is given twice; give each part once")
        seen.add(path.resolve())
    parts = [(str(path), read_json(path, "report")) for path in args.parts]
    batched = [name for name, report in parts if isinstance(report, dict) and "batches" in report]
    if batched and len(parts) > 1:
        raise SpecgraphError(f"report: {batched[0]} is a `bench --batch` report: batch reports are not merged (each "
                             "already holds all its prompts at every batch size); give it alone to print it")
    if batched:
        from specgraph.bench.batched import check_batched

        check_batched(*parts[0])
        return _present_batched(parts[0][1], args)
    _present_report(merge_reports(parts), args)


def _serial_in_one_process(graph, command: str, cannot: str) -> None:
    """Refuse, for `command`, a plan other than serial execution in one process (`cannot`: e.g.
    "cannot be exported yet")."""
    from specgraph.passes.place import world_size

    execution = graph.recipe.execution
    if execution != "serial":
        raise SpecgraphError(f"{command}: execution {execution!r} {cannot}; valid: serial")
    if world_size(graph) > 1:
        raise SpecgraphError(f"{command}: stages split over {world_size(graph)} devices {cannot}; "
                             "give each stage one device")


def cmd_serve(args: argparse.Namespace) -> None:
    from specgraph.recipe import Recipe
    from specgraph.serve.server import serve

    if not 0 <= args.port < 65536:
        raise SpecgraphError(f"--port: must be 0 to 65535 (got {args.port})")
    if args.grace is not None and not args.grace >= 0:
        raise SpecgraphError(f"--grace: must be 0 seconds or more (got {args.grace})")
    recipe = _served_recipe(args)
    if args.batch is not None and args.batch > 1 and recipe.execution != "serial":
        raise SpecgraphError(f"--batch: execution {recipe.execution!r} decodes one request at a time; give --batch 1, "
                             "or a serial recipe")
    serve(recipe, args.host, args.port, args.chat_template, args.api_key, args.widen, args.grace)


def _served_recipe(args: argparse.Namespace):
    """serve's RECIPE (a YAML file), or the recipe of a MODEL (a checkpoint folder, or a hub id
    in the local cache) served alone or over its --draft."""
    from specgraph.hub import cache_folder, cached_snapshot, is_hub_id
    from specgraph.recipe import Recipe

    source = args.recipe
    if source.is_file() or (source.suffix in (".yaml", ".yml") and not source.is_dir()):
        if args.draft is not None:
            raise SpecgraphError(f"--draft: {source} is a recipe, which names its own drafter; give a MODEL to serve "
                                 "with --draft, or put the drafter in the recipe")
        return Recipe.from_yaml(source, _overrides(args))
    if not source.exists() and not (is_hub_id(source.as_posix()) and cached_snapshot(source.as_posix())):
        raise SpecgraphError(f"MODEL: {source} is neither a recipe file, a checkpoint folder nor a model in the "
                             f"Hugging Face cache ({cache_folder()}); give one of them (download a model there "
                             "with `hf download ORG/NAME`)")
    draft = None if args.draft is None else Path(args.draft)
    if draft is not None and not draft.is_dir() and not (is_hub_id(args.draft) and cached_snapshot(args.draft)):
        found = "a file" if draft.exists() else f"neither a folder nor a model in the Hugging Face cache ({cache_folder()})"
        raise SpecgraphError(f"--draft: {draft} is {found}; a drafter is a checkpoint folder or a hub id (ORG/NAME, "
                             "downloaded with `hf download ORG/NAME`), not a recipe (a recipe names its own drafter: "
                             "serve the recipe)")
    return Recipe.of_models(source.as_posix(), args.draft, _overrides(args))


def cmd_loadgen(args: argparse.Namespace) -> None:
    from specgraph.loadgen import LoadSpec, run_loadgen

    for flag, value in (("--requests", args.requests), ("--concurrency", args.concurrency),
                        ("--max-tokens", args.max_tokens)):
        if value is not None and value < 1:
            raise SpecgraphError(f"{flag}: must be at least 1 (got {value})")
    if args.rate is not None and not args.rate > 0:
        raise SpecgraphError(f"--rate: must be above 0 requests/s (got {args.rate})")
    _check_report_outputs(args)
    args.prompt = None  # (read_prompts: loadgen takes a file only)
    prompts = [row["prompt"] for row in read_prompts(args, None)]
    run_loadgen(LoadSpec(args.url, prompts, args.requests, args.rate, args.concurrency, args.max_tokens, args.model,
                         args.api_key, args.allow_remote, args.seed), args.json, args.plot)


def cmd_compile(args: argparse.Namespace) -> None:
    from specgraph.export import check_exportable, check_program_folder, export_program
    from specgraph.passes import plan
    from specgraph.program import Program
    from specgraph.recipe import Recipe

    check_program_folder(args.output)  # before any work
    recipe = Recipe.from_yaml(args.recipe, [*args.overrides, "lowering.compile=false"])
    graph = plan(recipe)
    _serial_in_one_process(graph, "compile", "cannot be exported yet")
    check_exportable(graph)
    export_program(Program(graph), args.output)


def device_flag(value: str):
    """--device's value as a torch.device this machine has; a one-line error otherwise."""
    import torch

    try:
        device = torch.device(value)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise SpecgraphError(f"--device: {value!r} is not a device; valid: cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecgraphError(f"--device: {value} asked for, but this machine has no CUDA GPU; give --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise SpecgraphError(f"--device: {value} asked for, but this machine has {torch.cuda.device_count()} CUDA "
                             f"GPUs (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


def cmd_quantize(args: argparse.Namespace) -> None:
    from specgraph.quant.quantize import quantize_checkpoint

    if args.group_size is not None and args.group_size < 1:
        raise SpecgraphError(f"--group-size: must be at least 1 (got {args.group_size})")
    if (args.method == "awq") != (args.calibration is not None):
        raise SpecgraphError("--calibration: --method awq needs calibration prompts (--calibration PROMPTS.jsonl)"
                             if args.calibration is None else "--calibration: only --method awq reads calibration prompts")
    if args.device is not None and args.method != "awq":
        raise SpecgraphError("--device: only --method awq runs the model (rtn rounds on the CPU)")
    device = None if args.device is None else device_flag(args.device)
    calibration = None if args.calibration is None else [
        row["prompt"] for row in read_prompt_file(args.calibration, "--calibration")]
    print(f"wrote {quantize_checkpoint(args.source, args.output, args.scheme, args.group_size, calibration, device)}")


def cmd_train_draft(args: argparse.Namespace) -> None:
    from specgraph.train_head import TrainSpec, train

    layers = None
    if args.layers is not None:
        try:
            layers = tuple(int(x) for x in args.layers.split(","))
        except ValueError:
            raise SpecgraphError(f"--layers: three layer indices, as 2,4,5 (got {args.layers!r})") from None
    for flag, value in (("--steps", args.steps), ("--batch", args.batch), ("--ttt", args.ttt),
                        ("--draft-vocab", args.draft_vocab), ("--seq-len", args.seq_len - 2),
                        ("--decay-steps", args.decay_steps)):
        if value is not None and value < 1:
            raise SpecgraphError(f"{flag}: must be at least {3 if flag == '--seq-len' else 1}")
    if not args.lr > 0:
        raise SpecgraphError(f"--lr: must be above 0 (got {args.lr})")
    if args.ttt > args.seq_len - 2:
        raise SpecgraphError(f"--ttt: at most --seq-len - 2 rounds ({args.seq_len - 2}): round j predicts the token "
                             f"j + 2 ahead (got {args.ttt})")
    if args.intermediate_size is not None and args.intermediate_size < 1:
        raise SpecgraphError(f"--intermediate-size: must be at least 1 (got {args.intermediate_size})")
    device = str(device_flag(args.device))
    out = train(TrainSpec(args.target, args.data, args.output, args.steps, layers, args.lr, args.batch, args.seq_len,
                          args.ttt, args.draft_vocab, args.intermediate_size, args.dtype, args.seed,
                          args.decay_steps, args.init, device=device))
    print(f"wrote {out}")


def cmd_tune(args: argparse.Namespace) -> None:
    from specgraph.bench.tune import TuneSpec, grid, print_report, run_tune
    from specgraph.files import check_output, write_output
    from specgraph.passes import plan

    check_output(args.output, "-o")
    if args.rule != "bole" and args.epsilon is not None:
        raise SpecgraphError("--epsilon: it is the budget of --rule bole; give both, or neither")
    epsilon = BOLE_EPSILON if args.epsilon is None and args.rule == "bole" else args.epsilon
    if epsilon is not None and not epsilon > 0:
        raise SpecgraphError(f"--epsilon: must be > 0 (got {epsilon})")
    for flag, value in (("--max-prompts", args.max_prompts), ("--max-nodes", args.max_nodes)):
        if value < 1:
            raise SpecgraphError(f"{flag}: must be at least 1 (got {value})")
    candidates = grid(*(_whole_numbers(getattr(args, flag), f"--{flag}") for flag in ("widths", "depths", "nodes")),
                      args.max_nodes)
    if not candidates:
        raise SpecgraphError(f"--depths: every candidate is deeper than its node count (at most --max-nodes "
                             f"{args.max_nodes}); give smaller depths or more nodes")
    new_tokens = args.max_new_tokens or TUNE_NEW_TOKENS
    deepest = max(c.depth for c in candidates)
    if new_tokens <= 2 * (deepest + 1):
        raise SpecgraphError(f"--max-new-tokens: {new_tokens} is too few to measure trees {deepest} deep (a step "
                             f"may bring {deepest + 1} tokens); give more than {2 * (deepest + 1)}")
    recipe, prompts = _load_recipe(args)
    graph = plan(recipe)
    _serial_in_one_process(graph, "tune", "cannot be tuned yet (tune measures the serial executor's steps)")
    spec = TuneSpec(prompts[: args.max_prompts], new_tokens, candidates, args.rule, epsilon, args.widen)
    report = run_tune(graph, spec)
    print_report(report, spec)
    if report.chosen is None:
        raise SpecgraphError(f"--rule bole: {report.reason}")
    chosen = report.chosen
    header = (f"# {recipe.name}, tuned by `specgraph tune` ({args.rule} rule) on {report.device}: "
              f"stages.{report.stage}.tree {chosen.candidate}, expected {chosen.tokens_per_second:.1f} tokens/s, "
              f"epsilon {chosen.epsilon(report.verify_seconds[1]):.3f}\n")
    tuned = recipe.with_tree(report.stage, chosen.candidate.tree())
    write_output(args.output, header + tuned.to_yaml(args.output.parent))
    print(f"wrote {args.output}")


def _whole_numbers(text: str, flag: str) -> list[int]:
    try:
        numbers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < 1:
        raise SpecgraphError(f"{flag}: expected whole numbers of at least 1, comma-separated, e.g. 1,2,4 (got {text!r})")
    return numbers


def cmd_inspect(args: argparse.Namespace) -> None:
    from specgraph.files import check_output, write_output
    from specgraph.graph import SpecGraph
    from specgraph.passes import run_pipeline
    from specgraph.recipe import Recipe

    if args.dot is not None:
        check_output(args.dot, "--dot")
    recipe = Recipe.from_yaml(args.recipe, args.overrides)
    graph = SpecGraph.from_recipe(recipe)
    print(f"recipe {recipe.name}: execution {recipe.execution}\n{graph.describe()}")

    def show(graph_pass, after: SpecGraph) -> None:
        print(f"\nafter {graph_pass.__name__} (provides {', '.join(graph_pass.provides)}):\n"
              f"{after.describe(keys=graph_pass.provides)}")

    planned = run_pipeline(graph, after_each=show)
    if args.dot is not None:
        write_output(args.dot, planned.to_dot() + "\n")
        print(f"\nwrote {args.dot}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, exit status 2 (argparse's own prints the usage first)."""
        print(f"specgraph: error: {self.prog.removeprefix('specgraph ')}: {message} (see {self.prog} --help)",
              file=sys.stderr)
        sys.exit(2)


@contextlib.contextmanager
def build_progress():
    """The build's long steps (lower.py's log: loading, widening, building shapes, timing steps), a
    line each on stderr as they start (with a bar where a terminal shows one); SPECGRAPH_PROGRESS=1
    adds detail (each mode's measured times), SPECGRAPH_PROGRESS=0 silences them."""
    import logging
    import os

    setting = os.environ.get("SPECGRAPH_PROGRESS")
    if setting == "0":
        yield
        return
    log, handler = logging.getLogger("specgraph.build"), logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("specgraph: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if setting == "1" else logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)


def default_threads() -> int:
    """CPU threads for this process: every core it may use, less those other processes keep busy
    (by the one-minute load average), at least one: on a busy CPU, threads that wait for a core
    cost more than they bring."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, cores - round(os.getloadavg()[0]) + 1))


def main(argv: list[str] | None = None) -> int:
    import os
    import traceback

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    debug = args.debug or bool(os.environ.get("SPECGRAPH_DEBUG"))
    threads = None
    try:
        import torch  # (seconds: in here, a Ctrl-C during it ends as quietly as one later)

        threads = torch.get_num_threads()
        if args.threads is not None and args.threads < 1:
            raise SpecgraphError(f"--threads: must be at least 1 (got {args.threads})")
        torch.set_num_threads(args.threads or default_threads())
        if getattr(args, "batch", None) is not None and args.batch < 1:
            raise SpecgraphError(f"--batch: must be at least 1 (got {args.batch})")
        if getattr(args, "max_new_tokens", None) is not None and args.max_new_tokens < 1:
            raise SpecgraphError(f"--max-new-tokens: must be at least 1 (got {args.max_new_tokens})")
        if getattr(args, "prompt", None) is not None:  # (before any work, whichever command takes it)
            _text_argument(args.prompt, "--prompt")
        commands = {"run": cmd_run, "bench": cmd_bench, "compile": cmd_compile, "export": cmd_compile,
                    "inspect": cmd_inspect, "tune": cmd_tune, "report": cmd_report, "serve": cmd_serve,
                    "loadgen": cmd_loadgen, "train-draft": cmd_train_draft,
                    "quantize": cmd_quantize}
        from transformers.utils import logging as transformers_logging

        from specgraph.files import STDOUT, data_on_stdout

        verbosity = transformers_logging.get_verbosity()
        with warnings.catch_warnings(), build_progress(), (data_on_stdout() if str(getattr(args, "json", None)) ==
                                                           STDOUT else contextlib.nullcontext()):
            warnings.simplefilter("default", RecipeWarning)  # each once
            python_warning = warnings.showwarning

            def one_line(message, category, *rest) -> None:  # ours as one line; the libraries' with --debug only
                if issubclass(category, RecipeWarning):
                    print(f"specgraph: warning: {message}", file=sys.stderr)
                elif debug:
                    python_warning(message, category, *rest)

            warnings.showwarning = one_line
            if not debug:  # (transformers' advice to its own users, not to ours)
                transformers_logging.set_verbosity_error()
            try:
                return on_a_stack_chunk_of_its_own(lambda: commands[args.command](args)) or 0
            finally:
                transformers_logging.set_verbosity(verbosity)
    except SpecgraphError as exc:
        if debug:
            traceback.print_exc()
        print(f"specgraph: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specgraph: interrupted", file=sys.stderr)
        return 130
    finally:
        if threads is not None:
            torch.set_num_threads(threads)  # (main may run inside a longer process, as in the tests)


if __name__ == "__main__":
    sys.exit(main())

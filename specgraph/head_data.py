"""Training text for `specgraph train-draft` as EAGLE-3 makes it: the target's own continuations.

    python3 -m specgraph.head_data TARGET --data SPLIT.jsonl -o OUT.jsonl --val VAL.jsonl \\
        [--prompts N] [--prompt-tokens 256] [--new-tokens 128] [--temperatures 0,0.7] [--batch 32]

SPLIT.jsonl holds texts (`text` or `prompt`; scripts/eagle3_data.py writes the fixtures' training
split, never the held-out files). A text whose hash falls in one bucket of VAL_EVERY is the
validation split: its first --prompt-tokens tokens go to VAL.jsonl as a prompt (as the held-out
prompts are cut: a file's opening), and nothing of it to OUT. From each other text at least twice
--prompt-tokens long, prompts are cut at its opening and every 2 --prompt-tokens tokens after (at most
--cuts), and the target (transformers, fp32, batched) continues each for --new-tokens tokens: greedily,
or sampled at the next of --temperatures in turn; OUT gets each prompt and its continuation as one
`text`. Progress and tokens/s are shown; OUT is written batch by batch, and a run given the same
arguments resumes after the prompts OUT already holds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from specgraph.cli import device_flag
from specgraph.errors import SpecgraphError
from specgraph.text import Tokenizer
from specgraph.train_head import check_target, read_texts

VAL_EVERY = 32  # one text in VAL_EVERY (by hash) is the validation split


def is_validation(text: str) -> bool:
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) % VAL_EVERY == 0


def cut(texts: list[str], tokenizer: Tokenizer, prompt_tokens: int, cuts: int
        ) -> tuple[list[list[int]], list[list[int]]]:
    """The training prompts (token ids) and the validation prompts, in the texts' order."""
    train, val = [], []
    for text, ids in zip(texts, tokenizer.encode_all(texts)):
        if len(ids) < 2 * prompt_tokens:
            continue
        if is_validation(text):
            val.append(ids[:prompt_tokens])
            continue
        starts = range(0, len(ids) - 2 * prompt_tokens + 1, 2 * prompt_tokens)
        train += [ids[s : s + prompt_tokens] for s in list(starts)[:cuts]]
    return train, val


def _done(out: Path) -> int:
    """The prompts OUT already holds (whole lines)."""
    if not out.is_file():
        return 0
    return sum(1 for line in out.read_text().splitlines() if line.strip())


@torch.no_grad()
def generate(target: Path, prompts: list[list[int]], out: Path, new_tokens: int, temperatures: list[float],
             batch: int, seed: int, device: str = "cpu") -> int:
    """Continue `prompts` with the target (prompt i at temperatures[i % len]) into OUT, resuming
    after the prompts it holds -> the continuation tokens written in this run."""
    import transformers
    from tqdm import tqdm

    tokenizer = Tokenizer(target)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval().to(device)
    eos = model.config.eos_token_id
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else eos
    done, written, began = _done(out), 0, time.perf_counter()
    batches = [(t, group[b : b + batch]) for t in dict.fromkeys(temperatures)
               for group in [[i for i in range(len(prompts)) if temperatures[i % len(temperatures)] == t]]
               for b in range(0, len(group), batch)]  # each temperature's prompts batched together
    with out.open("a") as f, tqdm(total=len(prompts), initial=min(done, len(prompts)), desc="head-data",
                                   unit="prompt") as bar:
        first = 0
        for temperature, chosen in batches:
            first += len(chosen)
            if first <= done:  # (written by an earlier run)
                continue
            width = max(len(prompts[i]) for i in chosen)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in chosen])
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in chosen])
            torch.manual_seed(seed * 1_000_003 + first)  # (a resumed run draws the same)
            sampled = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {
                "do_sample": False}
            output = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                                    pad_token_id=pad, **sampled)[:, width:]
            for row, i in zip(output.tolist(), chosen):
                row = row[: row.index(eos)] if eos in row else row  # (an end of text: padding after it)
                f.write(json.dumps({"text": tokenizer.decode(prompts[i] + row), "temperature": temperature}) + "\n")
                written += len(row)
            f.flush()
            bar.update(len(chosen))
            bar.set_postfix(tok_s=f"{written / (time.perf_counter() - began):.0f}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m specgraph.head_data", description=__doc__.split("\n")[0])
    parser.add_argument("target", type=Path, metavar="TARGET")
    parser.add_argument("--data", type=Path, required=True, metavar="SPLIT.jsonl")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="OUT.jsonl")
    parser.add_argument("--val", type=Path, required=True, metavar="VAL.jsonl")
    parser.add_argument("--prompts", type=int, default=None, help="at most this many training prompts (default: all)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--cuts", type=int, default=2, help="prompts cut from one text at most (default 2)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", default="0,0,0.7", help="in turn, one a prompt; 0: greedy (default 0,0,0.7)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the target generates (default cpu)")
    args = parser.parse_args(argv)
    try:
        try:
            temperatures = [float(t) for t in args.temperatures.split(",")]
        except ValueError:
            raise SpecgraphError(f"--temperatures: numbers, as 0,0.7 (got {args.temperatures!r})") from None
        if any(t < 0 for t in temperatures):
            raise SpecgraphError(f"--temperatures: at least 0 (got {args.temperatures})")
        for flag, value in (("--prompt-tokens", args.prompt_tokens), ("--cuts", args.cuts),
                            ("--new-tokens", args.new_tokens), ("--batch", args.batch), ("--prompts", args.prompts)):
            if value is not None and value < 1:
                raise SpecgraphError(f"{flag}: must be at least 1 (got {value})")
        check_target(args.target, None)
        tokenizer = Tokenizer(args.target)
        train, val = cut(read_texts(args.data), tokenizer, args.prompt_tokens, args.cuts)
        train = train[: args.prompts]
        if not train:
            raise SpecgraphError(f"--data: {args.data} holds no text of {2 * args.prompt_tokens} tokens or more "
                                 "outside the validation split")
        args.val.write_text("".join(json.dumps({"id": f"val{n:04d}", "prompt": tokenizer.decode(ids)})
                                    + "\n" for n, ids in enumerate(val)))
        print(f"{len(train)} training prompts, {len(val)} validation prompts (written to {args.val})")
        written = generate(args.target, train, args.output, args.new_tokens, temperatures, args.batch, args.seed,
                           str(device_flag(args.device)))
        print(f"wrote {args.output}: {written} new tokens in this run")
    except SpecgraphError as exc:
        print(f"head_data: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

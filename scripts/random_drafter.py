"""A drafter that costs what the target does and is never right: the target's architecture and size
with random weights (transformers' own initialisation), its tokenizer beside it. What the speculation
policy must recognise and decline (docs/benchmarks.md):

  python3 scripts/random_drafter.py TARGET_FOLDER OUT_FOLDER [--seed N]
  specgraph bench recipes/dynamic.yaml --set models.draft.path=OUT_FOLDER --batch 1,4 --baselines ar ..."""
import argparse
import shutil
from pathlib import Path

import torch
import transformers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = transformers.AutoConfig.from_pretrained(args.target)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.out)
    for tokenizer_file in args.target.glob("*token*"):
        shutil.copy(tokenizer_file, args.out)
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()):,} parameters of random weights, "
          f"{config.model_type} as {args.target}")


if __name__ == "__main__":
    main()

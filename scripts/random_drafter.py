"""A drafter that is never right, what the speculation policy must recognise and decline
(docs/benchmarks.md): from a model's folder, one that costs what the model does (its architecture
and size with random weights, transformers' own initialisation, its tokenizer beside it); from an
EAGLE-3 head's folder, a head of its layout whose every weight is drawn at random at the scale of
the trained one's (its draft vocabulary kept).

  python3 scripts/random_drafter.py TARGET_FOLDER OUT_FOLDER [--seed N]
  specgraph bench recipes/dynamic.yaml --set models.draft.path=OUT_FOLDER --batch 1,4 --baselines ar ...
  python3 scripts/random_drafter.py recipes/models/eagle3 OUT_FOLDER
  specgraph bench recipes/eagle3.yaml --set models.draft.path=OUT_FOLDER --batch 1,4 --baselines ar ..."""
import argparse
import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    if "Eagle3" in " ".join(json.loads((args.target / "config.json").read_text()).get("architectures", [])):
        random_head(args.target, args.out)
        return
    config = transformers.AutoConfig.from_pretrained(args.target)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.out)
    for tokenizer_file in args.target.glob("*token*"):
        shutil.copy(tokenizer_file, args.out)
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()):,} parameters of random weights, "
          f"{config.model_type} as {args.target}")


def random_head(head: Path, out: Path) -> None:
    """The head in `head` with each floating tensor redrawn: normal, at its own mean and spread."""
    state = load_file(head / "model.safetensors")
    for name, tensor in state.items():
        if tensor.is_floating_point():
            values = tensor.float()
            state[name] = (values.mean() + values.std() * torch.randn_like(values)).to(tensor.dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors")
    shutil.copy(head / "config.json", out)
    print(f"{out}: an EAGLE-3 head of {head}'s layout, random weights")


if __name__ == "__main__":
    main()

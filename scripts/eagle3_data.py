"""The training split of the fixtures' corpus as `specgraph train-draft --data` reads it.

The fixtures (../shared/fixtures/train_code_models.py) are trained on this interpreter's standard
library and site-packages, less the files whose path hash falls in the held-out bucket, from which
prompts_code.jsonl is cut; this writes that same training split (its `collect`, the same order),
as JSON lines with a `text` field, up to MAX_BYTES of text. The held-out files are never written.

    python3 scripts/eagle3_data.py OUT.jsonl [MAX_BYTES]

`python3 -m specgraph.head_data TARGET --data OUT.jsonl ...` then has the target continue prompts cut
from it (the training text EAGLE-3 trains on) and keeps a validation split apart (docs/eagle.md).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "train_code_models.py"


def main(out: Path, max_bytes: int) -> None:
    spec = importlib.util.spec_from_file_location("train_code_models", FIXTURES)
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    train, _held_out = fixtures.collect(max_bytes)
    assert not any(fixtures.held_out(rel) for rel, _ in train)
    with out.open("w") as f:
        for _rel, text in train:
            f.write(json.dumps({"text": text}) + "\n")
    print(f"{out}: {len(train)} files, {sum(len(t) for _, t in train)} characters")


if __name__ == "__main__":
    if not 2 <= len(sys.argv) <= 3 or (len(sys.argv) == 3 and not sys.argv[2].isdigit()):
        sys.exit("usage: python3 scripts/eagle3_data.py OUT.jsonl [MAX_BYTES]")
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8_000_000)

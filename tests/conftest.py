import os

# Triton kernels run in the interpreter on the CPU; this must precede any @triton.jit import.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EMBEDDED = REPO / "recipes" / "models"  # the demo pair: target + draft, shipped in the repository
SHARED = REPO.parent / "shared" / "fixtures"  # mid, hybrid and the prompt file live only here


def shared_models() -> Path:
    if not (SHARED / "models").is_dir():
        pytest.skip("../shared/fixtures is not present")
    return SHARED / "models"


@pytest.fixture(scope="session")
def code_prompts() -> list[dict]:
    path = SHARED / "prompts_code.jsonl"
    if not path.is_file():
        pytest.skip("../shared/fixtures/prompts_code.jsonl is not present")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)

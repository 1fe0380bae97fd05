"""Timings of a build kept for the next one: the step costs a policy weighs and a budget's table
are measured once for a given (weights, shapes, settings, device, code) and saved as JSON in a folder beside
Inductor's compiled code, so that a second start of the same program on the same machine skips the
timing as it skips the compiling. SPECGRAPH_TIMINGS names another folder, or `0` to keep none;
removing the folder (or a file) makes the next build time again. A file that cannot be read is
timed again and rewritten."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from specgraph.errors import SpecgraphError
from specgraph.files import write_output

log = logging.getLogger("specgraph.build")
T = TypeVar("T")


def folder() -> Path | None:
    """Where timings are kept (None: nowhere)."""
    setting = os.environ.get("SPECGRAPH_TIMINGS")
    if setting == "0":
        return None
    if setting:
        return Path(setting)
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # (TORCHINDUCTOR_CACHE_DIR, or its default)

    return Path(cache_dir()) / "specgraph-timings"


@cache
def code_version() -> str:
    """A digest of specgraph's own source: a timing made by other code is not reused."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def weights_layout(model: nn.Module | object) -> str:
    """A digest of the name, shape and dtype of each of `model`'s tensors: a timing of other weights
    (another shape, another quantization of the same recipe's models) is not reused. A model that is
    no module (an exported package, its weights inside it: export.py's ExportedModel): its kind,
    shape and dtype."""
    if not isinstance(model, nn.Module):
        return f"{type(model).__name__} {model.shape} {model.dtype}"
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return digest.hexdigest()[:16]


def device_identity(device: torch.device) -> dict:
    """What a timing on `device` depends on besides the program: the chip, the libraries."""
    identity = {"torch": torch.__version__, "code": code_version()}
    if device.type == "cuda":
        return {**identity, "device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return {**identity, "device": device.type, "machine": platform.machine(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads()}


def _with_int_keys(pairs: list[tuple[str, object]]) -> dict:
    """JSON's string keys back to the batch sizes they were."""
    return {int(key) if key.isdigit() else key: value for key, value in pairs}


def remembered(what: str, identity: dict, measure: Callable[[], T]) -> T:
    """`measure()`'s result for `identity` (everything the timing depends on, JSON-able): read from
    the timings folder where a build of the same identity saved it, else measured and saved there.
    `what` names it in the log and in the file's name."""
    home = folder()
    if home is None:
        return measure()
    text = json.dumps(identity, sort_keys=True, default=str)
    path = home / f"{what.replace(' ', '-')}-{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"
    try:
        saved = json.loads(path.read_text(), object_pairs_hook=_with_int_keys)
        if saved["identity"] == text:
            log.info("%s as a build of the same program here measured them (%s)", what, path)
            return saved["value"]
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s: %s could not be read (%s); timing again", what, path, exc)
    value = measure()
    try:
        home.mkdir(parents=True, exist_ok=True)
        write_output(path, json.dumps({"identity": text, "value": value}, sort_keys=True))  # (atomically)
    except (OSError, SpecgraphError) as exc:
        log.warning("%s: not saved for the next build: %s", what, exc)
    return value

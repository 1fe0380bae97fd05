"""Model ids of the Hugging Face hub (`org/name`), found in the local cache, offline: through
huggingface_hub's own lookup (its cache layout, refs/main), never over the network."""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name (a path of two parts may be one)


def is_hub_id(text: str) -> bool:
    return HUB_ID.fullmatch(text) is not None and ".." not in text


def cache_folder() -> str:
    """The hub cache huggingface_hub looks in (HF_HUB_CACHE, or HF_HOME/hub)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def cached_snapshot(model_id: str) -> Path | None:
    """The local snapshot folder of hub id `model_id` (its main revision), or None where the cache has none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError):
        return None

"""Text at the edges: a checkpoint's tokenizer turns text into token ids and back (the engine sees ids only)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer


class Tokenizer:
    def __init__(self, checkpoint: Path):
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

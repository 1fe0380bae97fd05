"""Text at the edges: a checkpoint's tokenizer turns text into token ids and back, and a
conversation into the prompt its chat template makes (the engine sees ids only)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from specgraph.errors import CheckpointError, PromptError


class Tokenizer:
    def __init__(self, checkpoint: Path):
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=False)
        except Exception:  # (no tokenizer files, or damaged ones: transformers and tokenizers raise all kinds)
            raise CheckpointError(f"{checkpoint}: no tokenizer that transformers can load; give a checkpoint with its "
                                  "tokenizer files (tokenizer.json, tokenizer_config.json), undamaged") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_all(self, texts: list[str]) -> list[list[int]]:
        """encode of each text, in one batched call (the fast tokenizer's threads)."""
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's own chat template, if it has one."""
        return self.tokenizer.chat_template

    def chat(self, messages: list[dict], template: str | None = None) -> str:
        """The prompt text of a conversation ([{"role", "content"}], the assistant's turn to come),
        as transformers renders it with `template` (Jinja), else the checkpoint's own; a PromptError
        (field 'messages') where there is neither, or the template refuses the conversation."""
        from jinja2 import TemplateError

        if template is None and self.chat_template is None:
            raise PromptError("messages: this model's tokenizer has no chat template; use /v1/completions, or start "
                              "the server with --chat-template FILE", "messages")
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                      add_generation_prompt=True)
        except TemplateError as exc:  # (a template's raise_exception: e.g. roles that do not alternate)
            raise PromptError(f"messages: the chat template refuses them: {exc}", "messages") from None

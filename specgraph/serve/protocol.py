"""The OpenAI API's request shapes, validated into typed objects, and its error shape.

A body is checked whole before any work: wrong types (strictly: "5" is not a number), values out
of range, unknown fields and settings this server does not serve (n > 1, logprobs, penalties) are
an ApiError that names the field and what would be valid. vLLM's sampling extensions that
benchmark clients send (ignore_eos, min_tokens, stop_token_ids, include_stop_str_in_output,
skip_special_tokens) are served; others are unknown fields.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
INT64 = 1 << 63  # seeds are a signed 64-bit draw stream's (draws.py)


class ApiError(Exception):
    """A request refused: its HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampled(_Strict):
    """What both endpoints take: the model, the token budget, sampling, stop strings, streaming."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="an extension: 0 = no top-k filter")
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: list[str] = []  # (a string: a list of one)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    user: str | None = None
    # accepted only at the values that change nothing (clients send them as defaults)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    # vLLM's extensions
    ignore_eos: bool = Field(False, description="the end-of-sequence tokens do not end the request")
    min_tokens: int = Field(0, ge=0, description="new tokens before a stop token may come (they are not drawn before)")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field([], description="more tokens that end the request")
    include_stop_str_in_output: bool = Field(False, description="the text keeps the stop string or token that ended it")
    skip_special_tokens: bool = Field(True, description="special tokens are left out of the text")

    @field_validator("stop", mode="before")
    @classmethod
    def _listed(cls, stop):
        if stop is None or isinstance(stop, str):
            return [stop] if stop else []
        if not isinstance(stop, list):
            raise ValueError(f"give a string or a list of up to {MAX_STOPS} non-empty strings")
        return stop

    @field_validator("stop")
    @classmethod
    def _stops(cls, stops):
        if len(stops) > MAX_STOPS or not all(stops):
            raise ValueError(f"give a string or a list of up to {MAX_STOPS} non-empty strings")
        return stops

    @field_validator("n")
    @classmethod
    def _one(cls, n):
        if n not in (None, 1):
            raise ValueError("only n = 1 is served: one completion per request")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, penalty):
        if penalty not in (None, 0):
            raise ValueError("only 0 is served (no penalties)")
        return penalty

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, bias):
        if bias:
            raise ValueError("not served: give null or {}")
        return bias

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs):
        if logprobs not in (None, False):
            raise ValueError("not served: give null (or false)")
        return logprobs

    @property
    def usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampled):
    prompt: str  # (a list of one string: that string)

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens

    echo: bool | None = False
    best_of: int | None = 1
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_text(cls, prompt):
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request: a string, or a list of one string (got {len(prompt)} "
                                 "items; token-id prompts are not served)")
            return prompt[0]
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo):
        if echo:
            raise ValueError("not served: give false")
        return echo

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, best_of):
        if best_of not in (None, 1):
            raise ValueError("only best_of = 1 is served")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix):
        if suffix:
            raise ValueError("not served: give null")
        return suffix


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text} | ({"name": self.name} if self.name is not None else {})


class ChatRequest(_Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse(body: bytes, shape: type[_Strict]) -> _Strict:
    """A request body as `shape`, or an ApiError (400) naming the first field at fault and what is valid."""
    try:
        data = json.loads(body, parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # "\ud800": JSON, but not Unicode text (a tokenizer cannot take it)
        raise ApiError(400, "the request body holds a lone surrogate (\\uD800-\\uDFFF): not Unicode text") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object (got {type(data).__name__})")
    try:
        return shape.model_validate(data)
    except ValidationError as exc:
        raise _field_error(exc, shape) from None


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _field_error(exc: ValidationError, shape: type[_Strict]) -> ApiError:
    # the deepest error: a union field (a message's content) reports one per member, the one that
    # went further is the one meant; members name their type in the location, the fields are the rest
    error = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
    path = [str(p) for p in error["loc"] if isinstance(p, int) or ("[" not in p and p != "str")]
    param = ".".join(path) or None
    if error["type"] == "extra_forbidden":
        return ApiError(400, f"{param}: unknown field; valid fields here: {', '.join(_fields_at(shape, path[:-1]))}",
                        param)
    if error["type"] == "missing":
        return ApiError(400, f"{param}: required", param)
    message = error["msg"].removeprefix("Value error, ")
    got = error.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {json.dumps(got)[:80]})"
    return ApiError(400, f"{param}: {message}{shown}", param)


_NESTED = {"stream_options": StreamOptions, "messages": Message, "content": TextPart}  # field -> its items' shape


def _fields_at(shape: type[BaseModel], path: list[str]) -> list[str]:
    """The field names of the object at `path` (field names and list indices) in `shape`."""
    for part in path:
        shape = _NESTED.get(part, shape)
    return list(shape.model_fields)

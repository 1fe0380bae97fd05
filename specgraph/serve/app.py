"""The HTTP side: an ASGI app (Starlette) speaking the OpenAI API over an EngineLoop.

Handlers run on the event loop's thread, which alone uses the tokenizer. A request's body is
read (at most MAX_BODY bytes) and checked whole (protocol.py), its prompt tokenized (through the
chat template for chat), and its Job handed to the engine's thread; its events come back on an
asyncio queue. Requests wait their turn in the engine however many come, up to QUEUED_TOKENS
prompt tokens in flight (what their waiting costs is host memory), or serving.max_waiting
requests where the recipe sets it; past that a 503 with Retry-After. Streamed or not, a request's
text is a TextStream's pieces; a client that leaves (mid-stream, or while a whole answer is
decoded) has its job aborted, which frees its place in the batch at the engine's next message.
Each choice carries vLLM's `stop_reason` beside `finish_reason`: the stop string or stop token id
that ended it, null where none did (an end-of-sequence token, the token budget).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
import uuid

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specgraph.errors import PromptError
from specgraph.recipe import Recipe
from specgraph.serve.loop import Accepted, EngineLoop, Failed, Job, Refused, Tokens
from specgraph.serve.metrics import Metrics
from specgraph.serve.protocol import ApiError, ChatRequest, CompletionRequest, parse
from specgraph.serve.textstream import TextStream
from specgraph.text import Tokenizer

log = logging.getLogger("specgraph.serve")
MAX_BODY = 16 << 20  # bytes of a request body at most (a 413 past it)
QUEUED_TOKENS = 1 << 22  # prompt tokens of the requests in flight at most (some 150 MB of the host's memory)
RETRY_AFTER = 1  # seconds a client refused with a 503 (a full queue, the server stopping) is told to wait


class _Completion:
    """/v1/completions' objects."""

    prefix, whole, chunk = "cmpl", "text_completion", "text_completion"
    prompt_field = "prompt"

    @staticmethod
    def choice(text: str, finish: str | None, streamed: bool, stop_reason: str | int | None = None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}

    opening = None  # a stream's first chunk, before any text


class _Chat:
    """/v1/chat/completions' objects."""

    prefix, whole, chunk = "chatcmpl", "chat.completion", "chat.completion.chunk"
    prompt_field = "messages"

    @staticmethod
    def choice(text: str, finish: str | None, streamed: bool, stop_reason: str | int | None = None) -> dict:
        said = {"delta": {"content": text} if text or finish is None else {}} if streamed else {
            "message": {"role": "assistant", "content": text}}
        return {"index": 0, **said, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}

    opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
               "stop_reason": None}


class _Decoding:
    """One request's way through the engine, seen from the event loop: `start`, then `next` until
    it says the text is done, then `close` (always: it aborts the job where the engine has not
    finished it, and gives back the request's place in the queue's bound)."""

    def __init__(self, api: Api, prompt: list[int], max_tokens: int, body, shape):
        self.api, self.prompt, self.shape = api, prompt, shape
        self.id = uuid.uuid4().hex
        self.events: asyncio.Queue = asyncio.Queue()
        skip = body.skip_special_tokens
        self.text = TextStream(lambda ids: api.tokenizer.decode(ids, skip), body.stop, body.include_stop_str_in_output,
                               body.min_tokens)
        self.arrival, self.first = time.perf_counter(), None
        self.finish: str | None = None  # "stop" | "length" once the text is done
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if one did
        self.in_engine = False  # accepted and not yet finished there
        self.closed = False
        sampling, loop = api.sampling(body), asyncio.get_running_loop()

        def send(event) -> None:  # (the engine's thread)
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, event)
            except RuntimeError:  # the event loop is closed: nobody waits for this request any more
                pass

        api.in_flight += 1
        api.queued_tokens += len(prompt)
        api.engine.submit(Job(self.id, prompt, max_tokens, sampling, send, body.ignore_eos,
                              tuple(body.stop_token_ids), body.min_tokens))

    async def start(self) -> None:
        """Wait for the engine to take the job; an ApiError where it refuses it."""
        event = await self.events.get()
        if isinstance(event, Refused):
            field = {"prompt": self.shape.prompt_field, "max_new_tokens": "max_tokens"}.get(event.error.field,
                                                                                          event.error.field)
            raise ApiError(400, str(event.error), field)
        if isinstance(event, Failed):
            raise _failure(event)
        assert isinstance(event, Accepted), event
        self.in_engine = True
        self.api.metrics.admitted(len(self.prompt))

    async def next(self) -> str:
        """The next piece of text (sets `finish` once the text is done); an ApiError on a fault."""
        event = await self.events.get()
        if isinstance(event, Failed):
            self.in_engine = False
            self.api.metrics.ended("failed" if event.status == 500 else "aborted")
            raise _failure(event)
        assert isinstance(event, Tokens), event
        if self.first is None and event.ids:
            self.first = time.perf_counter()
            self.api.metrics.first_token(self.first - self.arrival)
        gen = event.generation
        self.in_engine = gen is None
        ended_by_token = gen is not None and gen.finish_reason == "stop"  # (a stop token: Output's "stop")
        piece = self.text.add(event.ids, last=gen is not None, stop_token=ended_by_token)
        if self.text.stopped:
            self.finish, self.stop_reason = "stop", self.text.stop
        elif gen is not None:
            self.finish = "stop" if gen.finish_reason == "stop" else "length"  # ("clipped": max_seq_len's length)
            self.stop_reason = event.stop_token
        if self.finish is not None:
            tokens = len(self.text.ids)
            after_first = time.perf_counter() - self.first
            self.api.metrics.ended(self.finish, after_first / (tokens - 1) if tokens > 1 else None)
        return piece

    def usage(self) -> dict:
        completion = len(self.text.ids)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": completion,
                "total_tokens": len(self.prompt) + completion}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.api.in_flight -= 1
        self.api.queued_tokens -= len(self.prompt)
        if self.in_engine:  # the client left, a stop string came, or the server stops
            self.api.engine.abort(self.id)
            if self.finish is None:
                self.api.metrics.ended("aborted")


class _EventStream(StreamingResponse):
    """A stream of server-sent events that closes its decoding however it ends (Starlette cancels it
    when the client leaves, maybe before its body is first iterated)."""

    def __init__(self, decoding: _Decoding, events):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.decoding = decoding

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.decoding.close()


def _event(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Api:
    def __init__(self, engine: EngineLoop, tokenizer: Tokenizer, recipe: Recipe, metrics: Metrics,
                 chat_template: str | None, api_key: str | None):
        """`chat_template`: Jinja, where the tokenizer's own is not to be used; `api_key`: the bearer
        key /v1 requires, None: none."""
        self.engine, self.tokenizer, self.recipe, self.metrics = engine, tokenizer, recipe, metrics
        self.chat_template, self.api_key = chat_template, api_key
        # requests accepted and not yet answered at most: a full batch and serving.max_waiting more (None: any)
        waiting = recipe.serving.max_waiting
        self.capacity = None if waiting is None else engine.backend.limit + waiting
        self.in_flight = self.queued_tokens = 0  # requests accepted and not yet answered, their prompt tokens
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [Route("/v1/models", self._endpoint(self.models, private=True), methods=["GET"]),
                  Route("/v1/models/{model:path}", self._endpoint(self.model, private=True), methods=["GET"]),
                  Route("/v1/completions", self._endpoint(self.completions, private=True), methods=["POST"]),
                  Route("/v1/chat/completions", self._endpoint(self.chat, private=True), methods=["POST"]),
                  Route("/health", self._endpoint(self.health), methods=["GET"]),
                  Route("/metrics", self._endpoint(self.metrics_text), methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})

    def _endpoint(self, handler, private: bool = False):
        """`handler` answering ApiErrors in OpenAI's error shape, and any other exception (a fault of
        ours, logged with its traceback) with a 500; `private`: only with the API key, if there is one."""

        async def endpoint(http: Request) -> Response:
            try:
                if private:
                    self._authorize(http)
                return await handler(http)
            except ApiError as exc:
                return JSONResponse(exc.body(), exc.status, headers=exc.headers)
            except ClientDisconnect:  # the client left before its request was whole: nobody to answer, no fault
                return Response(status_code=499)
            except Exception:  # noqa: BLE001 - a fault of ours: logged, and the server goes on
                log.exception("%s %s failed", http.method, http.url.path)
                return JSONResponse(ApiError(500, "the server failed on this request (its log has the traceback)",
                                             kind="server_error").body(), 500)

        return endpoint

    def _authorize(self, http: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = http.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    def _check_model(self, model: str) -> None:
        if model != self.recipe.name:
            raise ApiError(404, f"model {model!r} is not served here; this server serves {self.recipe.name!r} "
                           "(GET /v1/models)", "model", code="model_not_found")

    def sampling(self, body):
        """A request's sampling settings: the recipe's, with those it gives; a request at a temperature
        above 0 without a seed gets a random one (one with a seed is reproducible)."""
        given = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "seed")
                 if getattr(body, name) is not None}
        sampling = self.recipe.sampling.model_copy(update=given)
        if body.seed is None and sampling.temperature > 0:
            sampling = sampling.model_copy(update={"seed": secrets.randbits(63)})
        return sampling

    def _card(self) -> dict:
        return {"id": self.recipe.name, "object": "model", "created": self.created, "owned_by": "specgraph",
                "max_model_len": self.recipe.max_seq_len}

    async def models(self, http: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, http: Request) -> Response:
        self._check_model(http.path_params["model"])
        return JSONResponse(self._card())

    async def health(self, http: Request) -> Response:
        if not self.engine.thread.is_alive():
            raise ApiError(503, "the engine is not running", kind="server_error")
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, http: Request) -> Response:
        return Response(self.metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, http: Request) -> Response:
        body = parse(await _body(http), CompletionRequest)
        self._check_model(body.model)
        return await self._answer(http, body, self.tokenizer.encode(body.prompt), _Completion)

    async def chat(self, http: Request) -> Response:
        body = parse(await _body(http), ChatRequest)
        self._check_model(body.model)
        try:
            text = self.tokenizer.chat([m.as_template_input() for m in body.messages], self.chat_template)
        except PromptError as exc:
            raise ApiError(400, str(exc), "messages") from None
        return await self._answer(http, body, self.tokenizer.encode(text), _Chat)

    async def _answer(self, http: Request, body, prompt: list[int], shape) -> Response:
        if self.capacity is not None and self.in_flight >= self.capacity:
            self._full(f"{self.in_flight} requests are in flight (a batch of {self.engine.backend.limit} and "
                       f"serving.max_waiting {self.recipe.serving.max_waiting} waiting)")
        if self.queued_tokens + len(prompt) > QUEUED_TOKENS:
            self._full(f"{self.in_flight} requests of {self.queued_tokens} prompt tokens in all are in flight, and "
                       f"{QUEUED_TOKENS} may be")
        budget = body.token_budget or self.recipe.max_new_tokens
        if body.min_tokens > budget:
            raise ApiError(400, f"min_tokens: at most the token budget, max_tokens {budget} (got {body.min_tokens})",
                           "min_tokens")
        decoding = _Decoding(self, prompt, budget, body, shape)
        try:
            await decoding.start()
        except BaseException:
            decoding.close()
            raise
        head = {"id": f"{shape.prefix}-{decoding.id}", "object": None, "created": int(time.time()),
                "model": self.recipe.name}  # (the object's name: set below, in its place)
        if body.stream:
            return _EventStream(decoding, self._events(decoding, head, shape, body.usage_in_stream))
        try:
            return await self._whole(http, decoding, head, shape)
        finally:
            decoding.close()

    @staticmethod
    def _full(why: str) -> None:
        raise ApiError(503, f"the server is full: {why}; retry later", kind="server_error", code="overloaded",
                       headers={"Retry-After": str(RETRY_AFTER)})

    async def _events(self, decoding: _Decoding, head: dict, shape, usage: bool):
        """The server-sent events of a streamed answer: its pieces of text, the finish reason, the
        usage if asked, [DONE]; a fault mid-stream is an error event."""
        chunk = head | {"object": shape.chunk}
        try:
            if shape.opening is not None:
                yield _event(chunk | {"choices": [shape.opening]})
            while decoding.finish is None:
                piece = await decoding.next()
                if piece:
                    yield _event(chunk | {"choices": [shape.choice(piece, None, True)]})
            yield _event(chunk | {"choices": [shape.choice("", decoding.finish, True, decoding.stop_reason)]})
            if usage:
                yield _event(chunk | {"choices": [], "usage": decoding.usage()})
        except ApiError as exc:
            yield _event(exc.body())
        yield "data: [DONE]\n\n"

    async def _whole(self, http: Request, decoding: _Decoding, head: dict, shape) -> Response:
        """A whole answer, decoded while watching for the client to leave (then aborted)."""

        async def text() -> str:
            pieces = []
            while decoding.finish is None:
                pieces.append(await decoding.next())
            return "".join(pieces)

        async def left() -> None:
            while (await http.receive())["type"] != "http.disconnect":
                pass

        decoded, leaving = asyncio.ensure_future(text()), asyncio.ensure_future(left())
        try:
            await asyncio.wait({decoded, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (decoded, leaving):
                task.cancel()
        if not decoded.done() or decoded.cancelled():
            return Response(status_code=499)  # (nobody reads it: the client is gone)
        choice = shape.choice(decoded.result(), decoding.finish, False, decoding.stop_reason)
        return JSONResponse(head | {"object": shape.whole, "choices": [choice], "usage": decoding.usage()})


def _failure(event: Failed) -> ApiError:
    """A job the engine ended unfinished, as its error: a 503 (the server stops) says when to retry."""
    return ApiError(event.status, event.message, kind="server_error",
                    headers={"Retry-After": str(RETRY_AFTER)} if event.status == 503 else None)


async def _body(http: Request) -> bytes:
    """The request's body, refused (413) past MAX_BODY bytes before more is read."""
    declared = http.headers.get("content-length", "")
    too_large = ApiError(413, f"the request body is larger than {MAX_BODY >> 20} MiB", code="request_too_large")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise too_large
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _http_error(http: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such route, a method it does not take, a body too large) in OpenAI's shape."""
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = {404: f"no such endpoint: {http.url.path}; the API is under /v1 (GET /v1/models)",
               405: f"{http.method} is not served at {http.url.path}"}.get(exc.status_code, str(exc.detail))
    return JSONResponse(ApiError(exc.status_code, message, code=kind).body(), exc.status_code, headers=exc.headers)

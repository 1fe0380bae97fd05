"""`specgraph serve`: a program behind the OpenAI API until SIGTERM or Ctrl-C.

The socket is bound first (a port in use is a one-line error before any model loads), then the
program loads, its engine's thread starts, and uvicorn serves on the main thread. On SIGTERM or
Ctrl-C uvicorn stops taking connections; the requests in flight get `grace` seconds to finish, then
the engine's thread stops, answering those left with a 503 (an error event, mid-stream), and the
program closes: a multi-process program's processes at once if a request still holds them after
STOP_WAIT more seconds. The command then exits 0, grace + STOP_WAIT + a few seconds at most after
the signal (a second Ctrl-C skips the wait for requests).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading
from pathlib import Path

from specgraph.errors import SpecgraphError
from specgraph.recipe import Recipe

GRACE = 5.0  # seconds the requests in flight get to finish once the server is told to stop (default of --grace)
STOP_WAIT = 3.0  # seconds the engine's thread gets to end its step (or a multi-process request) after that
BACKSTOP = 5.0  # seconds more before uvicorn cancels the handlers still running (none should be)


class _Shutdown:
    """Stops the engine's thread, then the program, once (from a thread of its own when the grace
    is over, or from the main thread once uvicorn is done)."""

    def __init__(self, engine, program):
        self.engine, self.program = engine, program
        self.thread = threading.Thread(target=self._run, name="specgraph-shutdown", daemon=True)

    def _run(self) -> None:
        stopped = self.engine.stop(STOP_WAIT)
        self.program.close(now=not stopped)

    def begin(self) -> None:
        if self.thread.ident is None:  # (not started yet)
            self.thread.start()

    def finish(self) -> None:
        self.begin()
        self.thread.join()


def _server(config, shutdown: _Shutdown, grace: float):
    """uvicorn's Server, which begins `shutdown` `grace` seconds after it is told to stop."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            timer = asyncio.get_running_loop().call_later(grace, shutdown.begin)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server(config)


def read_chat_template(path: Path) -> str:
    """A --chat-template file's Jinja, checked to parse (a one-line error where it does not)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from specgraph.files import read_text

    template = read_text(path, "--chat-template")
    try:  # (the environment transformers renders chat templates in)
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError as exc:
        raise SpecgraphError(f"--chat-template: {path} line {exc.lineno}: {exc.message}") from None
    return template


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise SpecgraphError(f"--host/--port: cannot listen on {host}:{port} ({exc.strerror or exc})") from None


def serve(recipe: Recipe, host: str, port: int, chat_template: Path | None, api_key: str | None,
          widen: str | None, grace: float | None = None) -> None:
    """Serve until SIGTERM or Ctrl-C (`grace`: seconds the requests in flight then get, default GRACE)."""
    import uvicorn

    from specgraph.passes import plan
    from specgraph.program import Program
    from specgraph.serve.app import Api
    from specgraph.serve.loop import Batched, EngineLoop, OneAtATime
    from specgraph.serve.metrics import Metrics

    grace = GRACE if grace is None else grace
    template = read_chat_template(chat_template) if chat_template is not None else None
    if api_key is not None and not api_key.strip():
        raise SpecgraphError("--api-key: give a non-empty key")
    listener = bind(host, port)
    print(f"specgraph: loading {recipe.name} ({', '.join(s.name for s in recipe.stages)})", file=sys.stderr)
    program = Program(plan(recipe), widen=widen)
    shutdown = None
    try:
        backend = OneAtATime(program) if program.cluster is not None else Batched(program.executor)
        engine = EngineLoop(backend, Metrics(backend.limit, backend.counts, backend.modes))
        engine.start()
        shutdown = _Shutdown(engine, program)
        api = Api(engine, program.tokenizer, recipe, engine.metrics, template, api_key)
        logging.basicConfig(format="specgraph: %(levelname)s: %(name)s: %(message)s")
        server = _server(uvicorn.Config(api.app(), log_config=None, log_level="warning", access_log=False,
                                        lifespan="off", timeout_graceful_shutdown=grace + STOP_WAIT + BACKSTOP),
                         shutdown, grace)
        where = listener.getsockname()
        shown = f"[{where[0]}]" if listener.family == socket.AF_INET6 else where[0]
        waiting = recipe.serving.max_waiting
        print(f"specgraph: serving {recipe.name} at http://{shown}:{where[1]}/v1 (batch {backend.limit}, "
              f"{'the others wait their turn' if waiting is None else f'{waiting} waiting at most'}); Ctrl-C or "
              "SIGTERM stops", flush=True)
        # uvicorn handles SIGINT and SIGTERM while it serves, then raises the one it got again for
        # the handlers it found: here these, so that a stop it has handled ends as a normal exit
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run(sockets=[listener])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        listener.close()
        if shutdown is not None:
            shutdown.finish()
        else:
            program.close()

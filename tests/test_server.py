"""`specgraph serve` as its users meet it: real server processes on the embedded demo pair, driven
by the official `openai` client (and raw HTTP where a client would not send such a body). Greedy
answers are checked against a Program in this process decoding the same prompts; usage against
the tokenizer; batching, aborts and token counts against the server's /metrics."""

import asyncio
import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import torch
from conftest import REPO
from helpers import LONG_PROMPT, PROMPT, descendants, gone, interruptible

from specgraph.cli import main
from specgraph.program import Program
from specgraph.recipe import Recipe
from specgraph.serve.textstream import TextStream

DEMO = REPO / "recipes" / "demo.yaml"
NEW = 8  # tokens per request where a test does not need more (the server's max_new_tokens)
BATCH = 4  # the greedy server's requests decoded at once (the others wait their turn, however many)
WAITING = 2  # the sampling server's requests waiting at most (its batch: 2)
# a chat template of our own (the fixture tokenizer has none): each message on a line, then the assistant's turn
TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant:{% endif %}")
PROMPTS = [PROMPT, LONG_PROMPT, "import numpy as np\n\n\ndef softmax(x):\n", "class Stack:\n    def __init__(self):\n",
           "def fib(n):\n    if n < 2:\n", "# read the config file\nwith open("]
WAIT = 60  # seconds any one wait may take at most (a server start, a request)


class Served:
    """A `specgraph serve` subprocess: its URL once it listens, its stderr in a file."""

    def __init__(self, args: list[str], log: Path):
        self.log, self.err = log, log.open("w")
        command = [sys.executable, "-m", "specgraph", "serve", *args, "--port", "0", "--threads", "1"]
        # (a session of its own: a kill reaches every process it started)
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     start_new_session=True, preexec_fn=interruptible)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        try:
            line = lines.get(timeout=WAIT)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"the server did not start within {WAIT} s:\n{log.read_text()}") from None
        found = re.search(r"at (http://\S+)/v1 ", line)
        assert found, (line, log.read_text())
        self.url = found.group(1)

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=WAIT)

    def metrics(self) -> dict[str, float]:
        """/metrics' samples without labels or with a reason label: name -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=WAIT).text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+(?:\{reason=\"\w+\"\})?) (\S+)$", text, re.M)}

    def until(self, ready) -> dict[str, float]:
        """The metrics once `ready(metrics)` holds (polled; failing after WAIT seconds, to end a hang)."""
        deadline = time.monotonic() + WAIT
        while not ready(now := self.metrics()):
            assert time.monotonic() < deadline, now
            time.sleep(0.05)
        return now

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=WAIT)
        self.err.close()


def serving(args: list[str], log: Path):
    """A server for a module's tests, stopped (and every process of its session killed) after them."""
    served = Served(args, log)
    try:
        yield served
    finally:
        try:
            served.proc.send_signal(signal.SIGTERM)
            served.proc.wait(timeout=WAIT)
        finally:
            served.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The demo recipe, greedy, BATCH requests at once (the others wait), with TEMPLATE."""
    folder = tmp_path_factory.mktemp("server")
    (folder / "chat.jinja").write_text(TEMPLATE)
    yield from serving([str(DEMO), "--batch", str(BATCH), "--chat-template", str(folder / "chat.jinja"),
                        "--set", f"max_new_tokens={NEW}"], folder / "server.log")


@pytest.fixture(scope="module")
def sampler(tmp_path_factory):
    """The demo recipe at temperature 0.8, two requests at once and WAITING more at most, behind an
    API key, without a chat template; every step speculating (a seed reproduces tokens only then)."""
    folder = tmp_path_factory.mktemp("sampler")
    yield from serving([str(DEMO), "--batch", "2", "--api-key", "sesame", "--set", "stages.1.verify.rule=sampling",
                        "--set", "sampling.temperature=0.8", "--set", f"serving.max_waiting={WAITING}",
                        "--set", "serving.speculation=always",
                        "--set", f"max_new_tokens={NEW}"], folder / "sampler.log")


@pytest.fixture(scope="module")
def program():
    """The oracle: the demo recipe's program in this process, on one thread (the servers' share the
    cores: threads that wait for one cost far more than they bring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield Program.from_recipe(Recipe.from_yaml(DEMO))
    finally:
        torch.set_num_threads(threads)


def expected(program: Program, prompt: str, new: int = NEW) -> tuple[str, list[int]]:
    """`specgraph run`'s text and new ids for `prompt`."""
    gen = program.generate(program.encode(prompt), new)
    return program.decode(gen.output_ids), gen.output_ids


def streamed(stream) -> tuple[str, str | None, object]:
    """A completion stream's text joined, its finish reason and its usage (which only the last chunk
    may carry, with no choices, as OpenAI sends it)."""
    text, finish, usage = [], None, None
    for chunk in stream:
        assert usage is None, "a chunk after the usage"
        if chunk.usage is not None:
            usage = chunk.usage
            assert not chunk.choices
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else choice.delta.content
            text.append(piece or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage


def test_concurrent_greedy_completions_equal_run(server, program):
    before = server.metrics()
    client = server.client()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # more requests than the batch: some wait their turn
        answers = list(pool.map(lambda p: client.completions.create(model="demo", prompt=p, max_tokens=2 * NEW,
                                                                    temperature=0), PROMPTS))
    for prompt, answer in zip(PROMPTS, answers):
        text, ids = expected(program, prompt, 2 * NEW)
        assert answer.choices[0].text == text
        assert answer.choices[0].finish_reason == ("stop" if len(ids) < 2 * NEW else "length")
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(program.encode(prompt)), len(ids))
        assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
        assert answer.model == "demo" and answer.object == "text_completion"
    after = server.metrics()
    steps = after["specgraph_batch_occupancy_count"] - before["specgraph_batch_occupancy_count"]
    occupancy = (after["specgraph_batch_occupancy_sum"] - before["specgraph_batch_occupancy_sum"]) / steps
    assert occupancy * BATCH > 1.5  # the requests shared steps: more than 1.5 decoded per step on average
    assert after["specgraph_generation_tokens_total"] - before["specgraph_generation_tokens_total"] == sum(
        a.usage.completion_tokens for a in answers)


def test_streaming_equals_the_whole_answer(server, program):
    client = server.client()
    for prompt in PROMPTS[:2]:
        whole = client.completions.create(model="demo", prompt=prompt, max_tokens=NEW)
        text, finish, usage = streamed(client.completions.create(model="demo", prompt=prompt, max_tokens=NEW,
                                                                 stream=True, stream_options={"include_usage": True}))
        assert (text, finish) == (whole.choices[0].text, whole.choices[0].finish_reason)
        assert usage == whole.usage
    _, _, usage = streamed(client.completions.create(model="demo", prompt=PROMPT, max_tokens=NEW, stream=True))
    assert usage is None  # only where asked for


def test_chat_renders_the_template_and_streams_the_same(server, program):
    client = server.client()
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    prompt = "### system: You write Python.\n### user: def add(a, b):\n### assistant:"  # TEMPLATE, by hand
    text, ids = expected(program, prompt)
    answer = client.chat.completions.create(model="demo", messages=messages, max_tokens=NEW)
    assert answer.choices[0].message.content == text and answer.choices[0].message.role == "assistant"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(program.encode(prompt)), len(ids))
    chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=NEW, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    joined, finish, usage = streamed(chunks)
    assert (joined, finish, usage) == (text, answer.choices[0].finish_reason, answer.usage)
    parts = [{"role": "user", "content": [{"type": "text", "text": "def add"}, {"type": "text", "text": "(a, b):"}]}]
    assert client.chat.completions.create(model="demo", messages=parts, max_tokens=NEW).choices[0].message.content == (
        expected(program, "### user: def add(a, b):\n### assistant:")[0])


def test_stop_strings_cut_the_text_streamed_or_not(server, program):
    client = server.client()
    full, _ = expected(program, PROMPT, 24)
    stop = full[9:12]  # three characters from inside the text, where they first occur
    cut = full[: full.find(stop)]
    whole = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, stop=[stop, "never seen"])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (cut, "stop")
    text, finish, usage = streamed(client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, stop=stop,
                                                             stream=True, stream_options={"include_usage": True}))
    assert (text, finish) == (cut, "stop") and usage.completion_tokens < 24


ENDING = "if __name__ == '__main__':\n    main()\n"  # a file's end: the demo target's next token is EOS
EOS, NEWLINE = 0, 199  # the fixture tokenizer's end of sequence, and "\n"


def engine_ids(program: Program, prompt: str, new: int, **stopping) -> list[int]:
    """The new ids of `prompt` through the program's engine with a request's own stops and min_tokens."""
    request = program.executor.add_request(program.encode(prompt), new, stops=stopping.get("stops"),
                                           min_tokens=stopping.get("min_tokens", 0))
    while not request.finished:
        program.executor.step()
    return request.generation.output_ids


def test_vllms_stop_extensions_are_served_streamed_and_whole(server, program):
    """ignore_eos decodes max_tokens tokens past the EOS that ends the plain answer; min_tokens
    keeps EOS out of the first ones; stop_token_ids end the request (their text kept only with
    include_stop_str_in_output); skip_special_tokens false shows EOS's text; the usage comes in
    the last streamed chunk. Token ids against the engine in this process under the same rule."""
    client = server.client()
    assert engine_ids(program, ENDING, NEW) == [EOS]
    plain = client.completions.create(model="demo", prompt=ENDING, max_tokens=NEW)
    assert (plain.choices[0].text, plain.choices[0].finish_reason, plain.usage.completion_tokens) == ("", "stop", 1)

    def ask(**extra):
        return streamed(client.completions.create(model="demo", prompt=ENDING, max_tokens=NEW, stream=True,
                                                  stream_options={"include_usage": True}, extra_body=extra))

    ignored = engine_ids(program, ENDING, NEW, stops=())
    assert ignored[0] == EOS and len(ignored) == NEW
    text, finish, usage = ask(ignore_eos=True)
    assert (text, finish, usage.completion_tokens) == (program.decode(ignored), "length", NEW)
    text, _, _ = ask(ignore_eos=True, skip_special_tokens=False)
    assert text == program.tokenizer.decode(ignored, skip_special_tokens=False) and text != program.decode(ignored)
    at_least = engine_ids(program, ENDING, NEW, min_tokens=4)
    assert EOS not in at_least[:4] and len(at_least) > 4
    text, finish, usage = ask(min_tokens=4)
    assert (text, usage.completion_tokens) == (program.decode(at_least), len(at_least))
    second = at_least[1]  # a token it draws second: as a stop token, it ends the request there
    cut = engine_ids(program, ENDING, NEW, stops=(EOS, second), min_tokens=1)
    assert cut == at_least[:2] and program.decode(cut) != program.decode(cut[:1])
    text, finish, usage = ask(min_tokens=1, stop_token_ids=[second])
    assert (text, finish, usage.completion_tokens) == (program.decode(cut[:1]), "stop", 2)
    text, _, _ = ask(min_tokens=1, stop_token_ids=[second], include_stop_str_in_output=True)
    assert text == program.decode(cut)


def test_min_tokens_holds_stop_strings_back_too(server, program):
    """The issue's request: "def f():" with stop "\\n" ends at once, before any text; with min_tokens
    it ends at the first newline that a token past the first min_tokens brought (the demo target's
    20th token is a newline: it ends the text at min_tokens 19 and is passed over at 20)."""
    client = server.client()
    prompt, new = "def f():", 60
    plain = client.completions.create(model="demo", prompt=prompt, max_tokens=new, stop=["\n"])
    assert (plain.choices[0].text, plain.choices[0].finish_reason, plain.choices[0].stop_reason) == ("", "stop", "\n")
    for min_tokens in (19, 20):
        ids = engine_ids(program, prompt, new, min_tokens=min_tokens)
        full, held = program.decode(ids), program.decode(ids[:min_tokens])
        assert "\n" in held and full.find("\n", len(held)) > 0  # newlines held back, and one after them
        cut = full[: full.find("\n", len(held))]
        ask = dict(model="demo", prompt=prompt, max_tokens=new, stop=["\n"], extra_body={"min_tokens": min_tokens})
        whole = client.completions.create(**ask).choices[0]
        assert (whole.text, whole.finish_reason, whole.stop_reason) == (cut, "stop", "\n")
        text, finish, usage = streamed(client.completions.create(**ask, stream=True,
                                                                 stream_options={"include_usage": True}))
        assert (text, finish) == (cut, "stop") and min_tokens <= usage.completion_tokens < new
        assert ids[19] == NEWLINE and (cut == held) == (min_tokens == 19)


def raw_answer(server, path: str, body: dict) -> list[dict]:
    """The JSON objects of an answer as they come over HTTP: the whole answer, or each streamed chunk."""
    response = httpx.post(f"{server.url}{path}", json=body, timeout=WAIT)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        return [response.json()]
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_answers_have_the_openai_types_and_vllms_stop_reason(server, program):
    """Every answer, whole or streamed, validates as the `openai` client's types (Completion,
    ChatCompletion, ChatCompletionChunk: the fields clients read, usage and finish_reason among
    them); each choice's stop_reason is vLLM's: the stop string or stop token id that ended it, null
    where the end-of-sequence token (even one given in stop_token_ids) or the budget did."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    second = engine_ids(program, ENDING, NEW, min_tokens=4)[1]  # (test_vllms_stop_extensions...: not EOS)
    stop = expected(program, PROMPT, 24)[0][9:12]
    cases = [({"prompt": ENDING}, "stop", None), ({"prompt": PROMPT, "max_tokens": 2}, "length", None),
             ({"prompt": PROMPT, "max_tokens": 24, "stop": [stop]}, "stop", stop),
             ({"prompt": ENDING, "min_tokens": 1, "stop_token_ids": [second]}, "stop", second),
             ({"prompt": ENDING, "stop_token_ids": [EOS, second]}, "stop", None)]
    for fields, finish, reason in cases:
        for stream in (False, True):
            body = {"model": "demo", "max_tokens": NEW, "stream": stream, **fields}
            objects = raw_answer(server, "/v1/completions", body | {"stream_options": {"include_usage": True}}
                                 if stream else body)
            # (the type declares a finish reason, which OpenAI's streams too leave null until their end)
            answers = [Completion.model_validate(o) for o in objects if all(c["finish_reason"] for c in o["choices"])]
            last = [choice for answer in answers for choice in answer.choices][-1]
            assert {frozenset(c) for o in objects for c in o["choices"]} == {frozenset(last.model_dump())}
            assert (last.finish_reason, objects[-1 - stream]["choices"][0]["stop_reason"]) == (finish, reason), body
            assert answers[-1].usage.total_tokens == answers[-1].usage.prompt_tokens + answers[-1].usage.completion_tokens
    chat = {"model": "demo", "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": NEW}
    whole = raw_answer(server, "/v1/chat/completions", chat)[0]
    assert ChatCompletion.model_validate(whole).choices[0].message.role == "assistant"
    text = whole["choices"][0]["message"]["content"]
    assert whole["choices"][0]["stop_reason"] is None and len(text) > 2
    cut = raw_answer(server, "/v1/chat/completions", chat | {"stop": [text[1:3]], "stream": True})
    chunks = [ChatCompletionChunk.model_validate(c) for c in cut]
    assert chunks[-1].choices[0].finish_reason == "stop" and cut[-1]["choices"][0]["stop_reason"] == text[1:3]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[:1]


def test_stop_strings_can_stay_in_the_text(server, program):
    full, _ = expected(program, PROMPT, 24)
    stop = full[9:12]
    whole = server.client().completions.create(model="demo", prompt=PROMPT, max_tokens=24, stop=[stop],
                                               extra_body={"include_stop_str_in_output": True})
    assert whole.choices[0].text == full[: full.find(stop) + len(stop)]


def test_models_are_listed_and_retrieved_and_metrics_are_prometheus(server):
    from prometheus_client.parser import text_string_to_metric_families

    client = server.client()
    assert client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    client.completions.create(model="demo", prompt=PROMPT, max_tokens=2)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    assert families["specgraph_accepted_length"].type == "histogram"
    assert {s.labels["reason"] for s in families["specgraph_requests_finished"].samples} == {
        "stop", "length", "aborted", "failed"}
    running = families["specgraph_requests_running"].samples
    assert [s.value for s in running] == [0]  # idle now: the last step's request is done (it read 1 before)
    steps = {s.labels["mode"]: s.value for s in families["specgraph_steps"].samples}  # the policy's choices
    occupancy = next(s.value for s in families["specgraph_batch_occupancy"].samples if s.name.endswith("_count"))
    assert all(re.fullmatch(r"ar|depth \d+", mode) for mode in steps) and sum(steps.values()) >= occupancy >= 1


def test_a_body_too_large_or_left_half_sent_is_no_fault(server):
    """A 20 MB body: a 413 in OpenAI's shape; a client that hangs up mid-body: nothing to answer.
    Neither is logged as a server error."""
    response = httpx.post(f"{server.url}/v1/completions", timeout=WAIT, headers={"Content-Type": "application/json"},
                          content=b'{"model": "demo", "prompt": "' + b"x" * (20 << 20) + b'"}')
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"
    where = urlsplit(server.url)
    with socket.create_connection((where.hostname, where.port), timeout=WAIT) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n{\"model\": \"demo\", ")
    assert server.client().completions.create(model="demo", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    log = server.log.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log


def test_text_is_handed_out_whole_characters_and_never_a_stop_strings_start():
    """Byte 'tokens' decoded as UTF-8: a character's bytes split over steps, a stop string split
    over steps; the pieces never show a partial character or text the stop then takes back."""
    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    steps = [list("caf".encode()), list("é".encode())[:1], list("é".encode())[1:] + list(" <".encode()),
             list("/e".encode()), list("nd> more".encode())]
    stream = TextStream(decode, ["</end>"])
    pieces = [stream.add(ids, last=False) for ids in steps]
    assert pieces == ["caf", "", "é ", "", ""] and stream.stopped and stream.text == "café "
    unstopped = TextStream(decode, ["</end>"])
    assert "".join(unstopped.add(ids, last=i == 3) for i, ids in enumerate(steps[:4])) == "café </e"  # all, at the end
    assert not unstopped.stopped


def test_min_tokens_holds_stop_strings_back_as_vllm_does():
    """vLLM's rule (its detokenizer, PR 22014): a stop string counts only where it ends in text that
    a token after the first min_tokens brought, streamed in any steps."""
    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def text(stops: list[str], min_tokens: int, steps: list[bytes]) -> tuple[str, str | None]:
        stream = TextStream(decode, stops, min_tokens=min_tokens)
        pieces = [stream.add(list(step), last=i == len(steps) - 1) for i, step in enumerate(steps)]
        return "".join(pieces), stream.stop

    assert text(["\n"], 0, [b"a\nb\nc"]) == ("a", "\n")
    assert text(["\n"], 2, [b"a\nb\nc"]) == ("a\nb", "\n")  # the first two tokens' newline does not count
    assert text(["\n"], 2, [b"a", b"\n", b"b", b"\nc"]) == ("a\nb", "\n")
    assert text(["\n"], 1, [b"a\nb"]) == ("a", "\n")  # the second token's does
    assert text(["ab"], 1, [b"a", b"b"]) == ("", "ab")  # one that ends past them counts from where it begins
    assert text(["a"], 1, [b"a", b"b"]) == ("ab", None)
    assert text(["\n"], 5, [b"a\nb\nc"]) == ("a\nb\nc", None)  # the request ended before min_tokens


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


LONG_TEXT = "x = 1\n" * 2000  # far more tokens than max_seq_len (2048)
BAD_REQUESTS = [  # (path, body: bytes or a JSON object, status, the param named, words of the message)
    ("/v1/completions", b'{"model": "demo", "prompt": ', 400, None, "not valid JSON"),
    ("/v1/completions", b'["demo"]', 400, None, "JSON object"),
    ("/v1/completions", b'{"model": "demo", "prompt": "x", "max_tokens": NaN}', 400, None, "not valid JSON"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "greater than or equal"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "stream": "yes"}, 400, "stream", "valid boolean"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "serves 'demo'"),
    ("/v1/completions", {"prompt": "x"}, 400, "model", "required"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "n": 2}, 400, "n", "n = 1"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "temperature": 2.5}, 400, "temperature", "less than or equal"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "temperature": 0.7}, 400, "temperature", "greedily"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "top_k": -1}, 400, "top_k", "greater than or equal to 0"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "seed": 1 << 70}, 400, "seed", "less than"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "up to 4"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "logprobs": 3}, 400, "logprobs", "not served"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "best_of": 2}, 400, "best_of", "best_of = 1"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "colour": "red"}, 400, "colour", "unknown field"),
    ("/v1/completions", {"model": "demo", "prompt": [1, 2, 3]}, 400, "prompt", "token-id prompts"),
    ("/v1/completions", {"model": "demo", "prompt": ""}, 400, "prompt", "prompts need 1 to 2047 tokens"),
    ("/v1/completions", {"model": "demo", "prompt": LONG_TEXT}, 400, "prompt", "prompts need 1 to 2047 tokens"),
    ("/v1/completions", b'{"model": "demo", "prompt": "\\ud800"}', 400, None, "surrogate"),
    ("/v1/chat/completions", {"model": "demo", "messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages.0.role", "'user'"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages.0.content.0.type", "'text'"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": LONG_TEXT}]}, 400,
     "messages", "prompts need 1 to 2047 tokens"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                              "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage", "boolean"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens",
     "at most the token budget, max_tokens 2"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "min_tokens": NEW + 1}, 400, "min_tokens", "max_tokens 8"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids.0",
     "greater than or equal to 0"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "stop_token_ids": [4096]}, 400, "stop_token_ids",
     "ids 0 to 4095"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "stop_token_ids": list(range(1, 17))}, 400, "stop_token_ids",
     "at most 16 stop tokens"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos", "valid boolean"),
    ("/v1/completions", {"model": "demo", "prompt": "x", "repetition_penalty": 1.1}, 400, "repetition_penalty",
     "unknown field"),
    ("/v1/nothing", {}, 404, None, "no such endpoint"),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD_REQUESTS,
                         ids=[f"{i:02d}-{b[3] or b[4]}" for i, b in enumerate(BAD_REQUESTS)])
def test_a_bad_request_gets_its_4xx_and_the_server_keeps_serving(server, path, body, status, param, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"},
                          timeout=WAIT)
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["param"] == param and words in error["message"], error
    assert httpx.get(f"{server.url}/health", timeout=WAIT).json() == {"status": "ok"}


def test_the_openai_client_reads_the_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="demo", prompt="x", n=3)
    assert refused.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    response = httpx.get(f"{server.url}/v1/completions", timeout=WAIT)
    assert response.status_code == 405 and error_of(response)["code"] == "method_not_allowed"
    assert [m.id for m in client.models.list()] == ["demo"]


def test_a_client_that_leaves_frees_its_place(server):
    """BATCH streams and one whole answer, each of 2000 tokens, left as soon as they start: every
    one is aborted (not 2000 tokens later), and the next request is decoded alone."""
    before = server.metrics()
    with httpx.Client(timeout=WAIT) as http:
        for _ in range(BATCH):
            with http.stream("POST", f"{server.url}/v1/completions",
                             json={"model": "demo", "prompt": PROMPT, "max_tokens": 2000, "stream": True}) as stream:
                assert next(stream.iter_lines()).startswith("data: ")  # its first tokens came; then we leave
    server.until(lambda now: now["specgraph_requests_running"] == 0)
    where = urlsplit(server.url)
    with socket.create_connection((where.hostname, where.port), timeout=WAIT) as raw:
        body = json.dumps({"model": "demo", "prompt": PROMPT, "max_tokens": 2000}).encode()
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        server.until(lambda now: now["specgraph_requests_running"] == 1)  # admitted: decoding
    now = server.until(lambda now: now["specgraph_requests_running"] == 0)
    assert now["specgraph_requests_waiting"] == 0
    aborted = 'specgraph_requests_finished_total{reason="aborted"}'
    assert now[aborted] - before[aborted] == BATCH + 1
    assert now["specgraph_generation_tokens_total"] - before["specgraph_generation_tokens_total"] < 1000
    answer = server.client().completions.create(model="demo", prompt=PROMPT, max_tokens=NEW)
    after = server.metrics()
    # decoded alone: its tokens the only ones generated since, each step one request of the BATCH places
    assert after["specgraph_generation_tokens_total"] - now["specgraph_generation_tokens_total"] == (
        answer.usage.completion_tokens)
    steps = after["specgraph_batch_occupancy_count"] - now["specgraph_batch_occupancy_count"]
    assert steps > 0 and after["specgraph_batch_occupancy_sum"] - now["specgraph_batch_occupancy_sum"] == steps / BATCH


def test_seeds_reproduce_and_keys_guard(sampler):
    client = sampler.client("sesame")
    ask = dict(model="demo", prompt=PROMPT, max_tokens=NEW, temperature=0.8)
    alone = client.completions.create(**ask, seed=7).choices[0].text
    with ThreadPoolExecutor(2) as pool:  # the same seed beside another request: the same text
        beside = list(pool.map(lambda seed: client.completions.create(**ask, seed=seed).choices[0].text, (7, 8)))
    assert beside[0] == alone
    with pytest.raises(openai.BadRequestError, match="temperature"):  # a sampling recipe: no greedy requests
        client.completions.create(**ask | {"temperature": 0})
    with pytest.raises(openai.BadRequestError, match="no chat template.*--chat-template"):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}])
    for key in (None, "wrong"):
        response = httpx.post(f"{sampler.url}/v1/completions", json=ask,
                              headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=WAIT)
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        sampler.client("wrong").models.list()
    assert httpx.get(f"{sampler.url}/health", timeout=WAIT).status_code == 200  # probes need no key


def test_a_full_queue_is_refused_until_places_come_back(sampler):
    """serving.max_waiting caps the queue: two decoding and WAITING waiting fill it, and the next
    request is refused, with when to retry."""
    long = {"model": "demo", "prompt": PROMPT, "max_tokens": 2000, "stream": True, "ignore_eos": True}  # (no early end)
    key = {"Authorization": "Bearer sesame"}
    with httpx.Client(timeout=WAIT, headers=key) as http, ExitStack() as streams:
        for _ in range(2 + WAITING):
            stream = streams.enter_context(http.stream("POST", f"{sampler.url}/v1/completions", json=long))
            assert stream.status_code == 200
        refused = http.post(f"{sampler.url}/v1/completions", json={"model": "demo", "prompt": PROMPT})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
        assert "full" in error_of(refused)["message"] and "serving.max_waiting 2" in error_of(refused)["message"]
    deadline = time.monotonic() + WAIT
    while True:  # their places come back as the server sees them leave
        try:
            sampler.client("sesame").completions.create(model="demo", prompt=PROMPT, max_tokens=NEW)
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and time.monotonic() < deadline
            time.sleep(0.1)


def test_two_hundred_concurrent_requests_all_complete(server):
    """At the default settings requests queue: 200 at once through the openai client (no retries),
    a batch of BATCH decoding at a time, every one answered in full."""
    async def all_at_once() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                      timeout=10 * WAIT) as client:
            return await asyncio.gather(*(client.completions.create(model="demo", prompt=PROMPTS[i % len(PROMPTS)],
                                                                     max_tokens=2, extra_body={"ignore_eos": True})
                                          for i in range(200)))

    answers = asyncio.run(asyncio.wait_for(all_at_once(), 10 * WAIT))  # (the limit only ends a hang)
    assert len(answers) == 200 and all(a.usage.completion_tokens == 2 for a in answers)
    assert server.metrics()["specgraph_requests_running"] == 0


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "stream_options", "n", "user", "presence_penalty", "logit_bias", "logprobs", "echo",
          "suffix", "best_of", "frequency_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
          "include_stop_str_in_output", "skip_special_tokens", "nonsense"]


PLAUSIBLE = {  # values the greedy server serves, per field (fuzzed bodies take one more often than not)
    "temperature": [0, 0.0, None], "top_p": [1, 0.5, None], "top_k": [0, 5, None], "seed": [0, 42, -1, None],
    "stop": ["\n", ["(", ":"], [], None], "stream": [True, False, None], "n": [1, None], "user": ["me", None],
    "stream_options": [{"include_usage": True}, {}, None], "presence_penalty": [0, None], "frequency_penalty": [0],
    "logit_bias": [{}, None], "logprobs": [None, False], "echo": [False, None], "suffix": [None], "best_of": [1, None],
    "max_tokens": [1, 2, 3, None], "max_completion_tokens": [1, 2, None], "ignore_eos": [True, False],
    "min_tokens": [0, 1, 2], "stop_token_ids": [[], [199], [0, 13]], "include_stop_str_in_output": [True, False],
    "skip_special_tokens": [True, False]}


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["none", "bool", "int", "float", "text", "list", "object"] if depth < 2 else ["int", "text", "bool"]
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, 2, 3, -1, 4096, 1 << 63, -(1 << 64), rng.randrange(-100, 100)])
    if kind == "float":
        return rng.choice([0.0, 0.5, 1.0, 1.5, 2.0, -0.1, 1e308, rng.uniform(-3, 3)])
    if kind == "text":
        return "".join(rng.choice("ab \n\t\"\\{}[]é€😀\x00<>/") for _ in range(rng.randrange(0, 12)))
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(FIELDS + ["role", "content", "type", "text", "include_usage"]): random_value(rng, depth + 1)
            for _ in range(rng.randrange(0, 4))}


def random_body(rng: random.Random) -> tuple[str, bytes]:
    """A request (path, body): mostly a plausible one with a few fields changed at random, sent
    mostly to its endpoint; sometimes random JSON, sometimes bytes that are not JSON."""
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    roll = rng.random()
    if roll < 0.05:
        return path, bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
    if roll < 0.15:
        return path, json.dumps(random_value(rng)).encode()
    body = {"model": "demo", "max_tokens": rng.choice([1, 2, 3])}
    body |= {"prompt": rng.choice(PROMPTS)} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "def f(x):"}]}
    for _ in range(rng.randrange(1, 4)):
        field = rng.choice(FIELDS)
        if rng.random() < 0.1:
            body.pop(field, None)
        else:
            body[field] = (rng.choice(PLAUSIBLE[field]) if field in PLAUSIBLE and rng.random() < 0.6 else
                           random_value(rng))
    for budget in ("max_tokens", "max_completion_tokens"):
        if type(body.get(budget)) is int and body[budget] > 3:
            body[budget] = 3  # (bounds the time a valid request takes)
    text = json.dumps(body)
    if rng.random() < 0.1:
        text = text[: rng.randrange(len(text))]  # cut short
    return (rng.choice(["/v1/completions", "/v1/chat/completions"]) if rng.random() < 0.1 else path), text.encode()


def test_fuzzed_bodies_never_get_a_5xx_or_hang(server):
    rng = random.Random(34)
    bodies = [random_body(rng) for _ in range(200)]

    def send(request: tuple[str, bytes]) -> tuple[int, str]:
        path, body = request
        with httpx.Client(timeout=WAIT) as http:
            response = http.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"})
            if response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"):
                assert response.text.endswith("data: [DONE]\n\n")
            elif response.status_code != 200:
                error_of(response)
            return response.status_code, body.decode(errors="replace")

    with ThreadPoolExecutor(BATCH) as pool:
        outcomes = list(pool.map(send, bodies))
    assert not [(status, body) for status, body in outcomes if status >= 500]
    statuses = {status for status, _ in outcomes}
    assert 200 in statuses and 400 in statuses  # both kinds were tried
    assert server.metrics()["specgraph_requests_running"] == 0
    assert server.client().completions.create(model="demo", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_loadgen_reports_what_the_server_served(server, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out, plot = tmp_path / "load.json", tmp_path / "load.png"
    before = server.metrics()["specgraph_generation_tokens_total"]
    assert main(["loadgen", server.url, "--prompts", str(prompts), "--requests", "8", "--rate", "20",
                 "--max-tokens", str(NEW), "--json", str(out), "--plot", str(plot)]) == 0
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"], report["model"]) == (8, 0, "demo")
    assert report["output_tokens"] == server.metrics()["specgraph_generation_tokens_total"] - before
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 < report[key]["mean"] and report[key]["median"] <= report[key]["p99"]
    assert report["ttft_ms"]["median"] <= report["e2e_ms"]["median"]
    assert report["output_tokens_per_second"] == pytest.approx(report["output_tokens"] / report["duration_seconds"],
                                                               rel=1e-3)  # (the duration is rounded)
    assert plot.read_bytes().startswith(b"\x89PNG")
    printed = capsys.readouterr().out
    assert "8 completed, 0 failed" in printed and "time to 1st token" in printed
    assert main(["loadgen", server.url, "--prompts", str(prompts), "--requests", "2", "--concurrency", "1",
                 "--max-tokens", "2"]) == 0


def one_line_error(capsys, words: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specgraph: error: ") and words in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_command_line_mistakes_are_one_line_before_any_work(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    assert main(["loadgen", "http://192.0.2.1:8000", "--prompts", str(prompts), "--requests", "1"]) == 2
    one_line_error(capsys, "not this machine")
    assert main(["loadgen", "ftp://127.0.0.1", "--prompts", str(prompts), "--requests", "1"]) == 2
    one_line_error(capsys, "not an http(s) URL")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # (a port of this machine where nothing listens)
        down = f"http://127.0.0.1:{closed.getsockname()[1]}"
        for model in ([], ["--model", "demo"]):
            assert main(["loadgen", down, "--prompts", str(prompts), "--requests", "1", *model]) == 2
            assert capsys.readouterr().err.splitlines() == [
                f"specgraph: error: URL: no server answers at {down} (All connection attempts failed); start one "
                "(`specgraph serve RECIPE`), or give the URL it listens at"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", str(DEMO), "--port", str(taken.getsockname()[1])]) == 2
        one_line_error(capsys, "cannot listen on 127.0.0.1")
    template = tmp_path / "bad.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }")
    assert main(["serve", str(DEMO), "--chat-template", str(template)]) == 2
    one_line_error(capsys, "--chat-template")
    assert main(["serve", str(DEMO), "--batch", "2", "--set", "execution=disaggregated"]) == 2
    one_line_error(capsys, "one request at a time")


def test_a_request_the_stop_cuts_short_is_told_when_to_retry(tmp_path):
    """SIGTERM with --grace 0 while a whole answer is decoded: a 503 in OpenAI's shape, with
    Retry-After (a client retries another server, or this one once it is back)."""
    served = Served([str(DEMO), "--grace", "0"], tmp_path / "server.log")
    try:
        answers = []
        long = {"model": "demo", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}  # (no early end)
        asking = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{served.url}/v1/completions", json=long, timeout=WAIT)), daemon=True)
        asking.start()
        served.until(lambda now: now["specgraph_requests_running"] == 1)
        served.proc.send_signal(signal.SIGTERM)
        asking.join(WAIT)
        [refused] = answers
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
        assert "shutting down" in error_of(refused)["message"]
        assert served.proc.wait(timeout=WAIT) == 0, served.log.read_text()
    finally:
        served.kill()


def test_sigterm_ends_a_multi_process_server_and_every_process_it_started(tmp_path, program):
    """The disaggregated recipe (its ranks in processes of their own) answers as the target alone
    does; SIGTERM mid-request: the request ends with an error event before its first token (the
    ranks were stopped, not waited for), the command exits 0, and no process it started is left."""
    served = Served([str(REPO / "recipes" / "disaggregated.yaml"), "--grace", "1"], tmp_path / "server.log")
    try:
        client = served.client()
        assert client.completions.create(model="disaggregated", prompt=PROMPT, max_tokens=NEW).choices[0].text == (
            expected(program, PROMPT)[0])
        processes = descendants(served.proc.pid)  # the ranks, the fork server they come from, the resource tracker
        assert len(processes) >= 3, processes
        long = {"model": "disaggregated", "prompt": PROMPT, "max_tokens": 2000, "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", timeout=WAIT, json=long) as stream:
            # in the engine (a multi-process server's gauges, read before each step, show it waiting)
            served.until(lambda now: now["specgraph_requests_running"] + now["specgraph_requests_waiting"] == 1)
            served.proc.send_signal(signal.SIGTERM)
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        # cut short: a multi-process program streams a request whole, at its end, and this one sent nothing
        assert len(events) == 2 and "shutting down" in events[0] and events[1] == "data: [DONE]", events
        assert served.proc.wait(timeout=WAIT) == 0, served.log.read_text()
        assert gone(processes), processes
        assert "Traceback" not in served.log.read_text()
    finally:
        served.kill()

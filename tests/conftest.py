import os

import torch

# Without a GPU, Triton kernels run in the interpreter; this must precede any @triton.jit import.
# (On a GPU it must not: Inductor's own Triton kernels would run interpreted.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))
os.environ["SPECGRAPH_TIMINGS"] = "0"  # (every build times its own steps: tests price them differently)
os.environ["SPECGRAPH_PROGRESS"] = "0"  # (what commands print is asserted: a test that wants the build's steps asks)
if "PYTEST_XDIST_WORKER" in os.environ:  # one of several test processes (pyproject.toml): a core each
    os.environ["OMP_NUM_THREADS"] = "1"  # (and the processes tests start)
    torch.set_num_threads(1)

import inspect  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NoReturn  # noqa: E402

import pytest  # noqa: E402

from specgraph.stack import on_a_stack_chunk_of_its_own  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EMBEDDED = REPO / "recipes" / "models"  # the demo pair: target + draft, shipped in the repository
SHARED = REPO.parent / "shared" / "fixtures"  # mid, hybrid and the whole prompt file live only here
# the first 16 prompts of ../shared/fixtures/prompts_code.jsonl, shipped: tests over the demo pair run in any clone
SHIPPED_PROMPTS = REPO / "tests" / "prompts_code.jsonl"


LOCAL = REPO / ".fixtures"  # what a GPU machine, which gets only the checkout, has of ../shared/fixtures


def absent(what: str) -> NoReturn:
    """End the calling test for want of `what` (a fixture of ../shared, a reference package): a skip,
    except under CI (CI=true), which must have everything: there a failure."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is not present, and under CI (CI=true) every test must run", pytrace=False)
    pytest.skip(f"{what} is not present")


def shared_model(name: str) -> Path:
    """The fixture model `name` of ../shared/fixtures/models, or of .fixtures/ where a GPU machine got
    only the checkout."""
    for folder in (SHARED / "models", LOCAL):
        if (folder / name).is_dir():
            return folder / name
    absent(f"../shared/fixtures/models/{name}")


def shared_prompts() -> Path:
    for path in (SHARED / "prompts_code.jsonl", LOCAL / "prompts_code.jsonl"):
        if path.is_file():
            return path
    absent("../shared/fixtures/prompts_code.jsonl")


def _read_prompts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="session")
def code_prompts() -> list[dict]:
    """The shipped code prompts (SHIPPED_PROMPTS), the same in every checkout."""
    return _read_prompts(SHIPPED_PROMPTS)


@pytest.fixture(scope="session")
def all_code_prompts() -> list[dict]:
    """All 64 code prompts of ../shared (a test that needs more than the 16 shipped)."""
    return _read_prompts(shared_prompts())


PROMPTS, NEW_TOKENS = 16, 128  # the greedy-equivalence tests: held-out code prompts x new tokens


def once_per_run(tmp_path_factory, name: str, compute) -> list[tuple[list[int], list[int]]]:
    """`compute()`'s [(prompt ids, new ids)], computed by one of the run's test processes and read by the
    others (xdist's workers share their base folder's parent; a lock makes the others wait)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return compute()
    from filelock import FileLock

    path = tmp_path_factory.getbasetemp().parent / f"{name}.json"
    with FileLock(f"{path}.lock"):
        if not path.is_file():
            path.write_text(json.dumps(compute()))
        return [tuple(pair) for pair in json.loads(path.read_text())]


@pytest.fixture(scope="session")
def target_reference(code_prompts, tmp_path_factory):
    """transformers' greedy continuation (fp32) of the first prompts by the target fixture: [(prompt ids, new ids)]."""
    from helpers import hf_greedy

    return once_per_run(tmp_path_factory, "target_reference",
                        lambda: hf_greedy(EMBEDDED / "target", code_prompts[:PROMPTS], NEW_TOKENS))


@pytest.fixture(scope="session")
def hybrid_reference(code_prompts, tmp_path_factory):
    """The same by the hybrid (Qwen3.5) fixture."""
    from helpers import hf_greedy

    hybrid = shared_model("hybrid")
    return once_per_run(tmp_path_factory, "hybrid_reference", lambda: hf_greedy(hybrid, code_prompts[:PROMPTS], NEW_TOKENS))


@pytest.fixture(scope="session")
def small_hybrid(tmp_path_factory) -> Path:
    """A small hybrid drafter for the hybrid fixture: its first four layers (helpers.shallow_hybrid)."""
    from helpers import shallow_hybrid

    return shallow_hybrid(shared_model("hybrid"), tmp_path_factory.mktemp("drafter"))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


KERNEL_TESTS = ("tests/test_invariant_kernels.py", "tests/test_kernels.py")  # tests/test_kernels_compile.py
KERNEL_FILES = (*KERNEL_TESTS, "tests/test_kernels_compile.py")  # one process's, in this order (the compile last)
KERNEL_LAUNCHES: dict[str, list[str]] = {}  # node id of a kernel test that passed in this session -> its launches


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Keep the interpreted kernel launches of each kernel test that passes (test_kernels_compile.py compiles them)."""
    if os.environ.get("TRITON_INTERPRET") != "1" or f"tests/{item.path.name}" not in KERNEL_TESTS:
        return (yield)
    from kernel_launches import recording

    lines = []
    with recording(lines):
        result = yield  # (raises where the test failed)
    KERNEL_LAUNCHES[item.nodeid] = lines
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Each test function called as pytest calls it, on a frame-stack chunk of its own (specgraph/stack.py): in
    xdist's workers, whose tests run deeper than under a plain pytest, the Triton interpreter's calls of
    test_fused_program.py landed first in a chunk and took 2.4x their time."""
    test = pyfuncitem.obj
    arguments = {name: pyfuncitem.funcargs[name] for name in inspect.signature(test).parameters}
    on_a_stack_chunk_of_its_own(lambda: test(**arguments))
    return True


def pytest_sessionfinish(session):
    path = os.environ.get("SPECGRAPH_RECORD_LAUNCHES")  # set where test_kernels_compile.py started this session
    if path:
        Path(path).write_text("".join(f"{line}\n" for lines in KERNEL_LAUNCHES.values() for line in lines))


# the files that take minutes on the 2-core CPU machine (--durations), longest first: handed out first, so that
# the short ones even out the processes' ends (xdist hands files out by their count of tests)
LONGEST_FILES = ("tests/test_disaggregated.py", "tests/test_pipeline.py", "tests/test_compile.py",
                 "tests/test_quant.py", "tests/test_hybrid.py", "tests/test_greedy_equivalence.py", "tests/test_docs.py",
                 "tests/test_fused_program.py")


def pytest_xdist_make_scheduler(config, log):
    """Where the suite runs in several processes (pyproject.toml: --dist=loadfile), a file's tests in one,
    except that the kernel tests and the test that compiles their launches share one (which then compiles
    the launches it recorded instead of running the kernel tests again); LONGEST_FILES first."""
    from xdist.scheduler import LoadFileScheduling

    class KernelFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "kernel tests" if path in KERNEL_FILES else path

        def _assign_work_unit(self, node) -> None:
            for path in reversed(LONGEST_FILES):  # (each to the front of the queue: the first ends up first)
                if path in self.workqueue:
                    self.workqueue.move_to_end(path, last=False)
            super()._assign_work_unit(node)

    return KernelFilesTogether(config, log)

"""Every Triton kernel compiles for a Hopper GPU, checked on the CPU (tests/kernel_launches.py says why)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import KERNEL_LAUNCHES, KERNEL_TESTS, REPO
from kernel_launches import launched_kernels


def kernel_test_launches(path: Path) -> None:
    """Write to `path` the launches of every kernel test: this process's, where it passed them all, else
    those of a run of the kernel tests in a subprocess (one process: where the suite runs in several,
    the kernel tests may have run in another)."""
    quiet = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # (one node id a line)
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p",
                             "no:cacheprovider", *KERNEL_TESTS], cwd=REPO, env=quiet, capture_output=True, text=True,
                            timeout=300)
    ids = [line for line in listed.stdout.splitlines() if line.startswith(KERNEL_TESTS)]
    assert listed.returncode == 0 and ids, listed.stdout[-3000:]
    if all(i in KERNEL_LAUNCHES for i in ids):
        path.write_text("".join(f"{line}\n" for i in ids for line in KERNEL_LAUNCHES[i]))
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "SPECGRAPH_RECORD_LAUNCHES": str(path)}
    tested = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-o", "addopts=", "-p", "no:cacheprovider",
                             *KERNEL_TESTS],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert tested.returncode == 0, tested.stdout[-3000:]


def test_every_kernel_as_the_kernel_tests_launch_it_compiles_for_hopper(tmp_path):
    launches = tmp_path / "launches.jsonl"
    kernel_test_launches(launches)
    recorded = {(launch["module"], launch["kernel"]) for launch in map(json.loads, launches.read_text().splitlines())}
    unlaunched = launched_kernels() - recorded
    assert not unlaunched, f"never launched by {KERNEL_TESTS}: {sorted(unlaunched)}"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPECGRAPH_RECORD_LAUNCHES")}
    compiled = subprocess.run([sys.executable, "tests/kernel_launches.py", str(launches)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=900)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr[-3000:]

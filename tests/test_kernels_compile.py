"""Every Triton kernel compiles for a Hopper GPU, checked on the CPU (tests/kernel_launches.py says why)."""

import json
import os
import subprocess
import sys

from conftest import REPO
from kernel_launches import launched_kernels

KERNEL_TESTS = ("tests/test_kernels.py", "tests/test_invariant_kernels.py")


def test_every_kernel_as_the_kernel_tests_launch_it_compiles_for_hopper(tmp_path):
    launches = tmp_path / "launches.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "1", "SPECGRAPH_RECORD_LAUNCHES": str(launches)}
    tested = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert tested.returncode == 0, tested.stdout[-3000:]
    recorded = {(launch["module"], launch["kernel"]) for launch in map(json.loads, launches.read_text().splitlines())}
    unlaunched = launched_kernels() - recorded
    assert not unlaunched, f"never launched by {KERNEL_TESTS}: {sorted(unlaunched)}"
    del env["TRITON_INTERPRET"], env["SPECGRAPH_RECORD_LAUNCHES"]
    compiled = subprocess.run([sys.executable, "tests/kernel_launches.py", str(launches)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=900)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr[-3000:]

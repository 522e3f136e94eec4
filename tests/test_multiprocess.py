"""Two JAX processes, as a multi-host run has them (jax.distributed with a coordinator on
localhost, one global mesh over both processes' host devices): the sharding rules, ring
attention and the sharded training example through scripts/multiprocess_check.py. On the
two-GPU machine the same script runs one process per GPU (README, "Several GPUs")."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_check(checks):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/multiprocess_check.py"), "--platform", "cpu",
         "--processes", "2", "--devices-per-process", "2", "--checks", checks,
         "--timeout", "400"],
        cwd=ROOT, capture_output=True, text=True, timeout=450, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return result.stdout


def test_sharding_and_ring_across_two_processes():
    out = run_check("sharding,ring")
    assert out.count("ok sharding") == 2 and out.count("ok ring over 4 devices") == 2


def test_sharded_example_across_two_processes():
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    out = run_check("example")
    assert out.count("ok example: dp-tp") == 2

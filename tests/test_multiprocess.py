"""Two JAX processes, as a multi-host run has them (jax.distributed with a coordinator on
localhost, one global mesh over both processes' host devices): the sharding rules, ring
attention and the sharded training example through scripts/multiprocess_check.py. On the
two-GPU machine the same script runs one process per GPU (README, "Several GPUs")."""

import importlib.util
import os
import pathlib
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_check(checks):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/multiprocess_check.py"), "--platform", "cpu",
         "--processes", "2", "--devices-per-process", "2", "--checks", checks,
         "--timeout", "400"],
        cwd=ROOT, capture_output=True, text=True, timeout=450, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return result.stdout


def test_sharding_ring_and_example_across_two_processes():
    """One launch for every check (the example's only where Flax and Optax are installed):
    starting two processes and jax.distributed is most of each check's cost."""
    example = all(importlib.util.find_spec(name) for name in ("flax", "optax"))
    out = run_check("sharding,ring,example" if example else "sharding,ring")
    assert out.count("ok sharding") == 2 and out.count("ok ring over 4 devices") == 2
    if example:
        assert out.count("ok example: dp-tp") == 2

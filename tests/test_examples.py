"""The examples run as a user runs them (short settings), as subprocesses."""

import json
import os
import subprocess
import sys
import pathlib

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("tqdm")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args, cwd):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=600)


def test_train_gpt2_defaults_write_a_log_and_a_plot(tmp_path):
    """Default flags (as the README's main command), fewer steps: the run writes its outputs
    under runs/ and the loss falls."""
    result = run(str(ROOT / "examples/train_gpt2.py"), "--steps", "30", "--eval-every", "15",
                 "--n-layer", "2", "--seq-len", "64", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    log = json.loads((run_dir / "log.json").read_text())
    losses = [entry["loss"] for entry in log["train"]]
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.0
    assert log["tokens_per_s"] > 0
    assert (run_dir / "loss.png").stat().st_size > 10_000


def test_seed_example_passes_its_own_check():
    result = run(str(ROOT / "examples/seed_sdpa_backward.py"), cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.count(" ok ") == 4


@pytest.mark.parametrize("mode", ["dp-tp", "sequence"])
def test_sharded_training_on_eight_host_devices(mode, tmp_path):
    """examples/sharded_training.py on 8 CPU devices (data x model = 4 x 2, or a ring of 8):
    it trains (the loss falls). On a GPU machine it uses the visible GPUs instead."""
    env_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples/sharded_training.py"), "--mode", mode,
         "--steps", "12", "--seq-len", "128"], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, env=dict(os.environ, XLA_FLAGS=env_flags, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
    assert result.returncode == 0, result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("done:")][0]
    first, last = (float(x) for x in line.split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first - 1.0, line

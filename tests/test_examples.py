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


@pytest.mark.parametrize("rows", ["packed", "padded"])
def test_train_gpt2_on_documents(rows, tmp_path):
    """--pack (rows packed with whole files as documents) and --rows padded train, and report
    the tokens that carry a loss per second."""
    flag = ["--pack"] if rows == "packed" else ["--rows", "padded"]
    result = run(str(ROOT / "examples/train_gpt2.py"), *flag, "--steps", "24", "--eval-every",
                 "12", "--n-layer", "2", "--seq-len", "64", "--out-dir", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    log = json.loads((tmp_path / "out" / "log.json").read_text())
    assert log["args"]["rows"] == rows and log["tokens_per_s"] > 0
    losses = [entry["loss"] for entry in log["train"]]
    assert losses[-1] < losses[0] - 1.0


def test_train_gpt2_with_soft_cap_and_learned_sinks(tmp_path):
    """--logits-soft-cap and --sinks train (the sinks a parameter per head: they move), and
    --sinks with a jax.nn attention is refused by name."""
    result = run(str(ROOT / "examples/train_gpt2.py"), "--logits-soft-cap", "5", "--sinks",
                 "--pack", "--steps", "24", "--eval-every", "12", "--n-layer", "2",
                 "--seq-len", "64", "--out-dir", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    log = json.loads((tmp_path / "out" / "log.json").read_text())
    assert log["args"]["sinks"] and log["args"]["logits_soft_cap"] == 5.0
    losses = [entry["loss"] for entry in log["train"]]
    assert losses[-1] < losses[0] - 1.0
    assert log["sinks_moved"] > 0
    refused = run(str(ROOT / "examples/train_gpt2.py"), "--sinks", "--attention", "xla",
                  "--steps", "1", cwd=tmp_path)
    assert refused.returncode != 0 and "--sinks" in refused.stderr


def test_train_gpt2_with_alibi(tmp_path):
    """--alibi trains without learned positions (fewer parameters), and is refused by name
    with a jax.nn attention."""
    result = run(str(ROOT / "examples/train_gpt2.py"), "--alibi", "--steps", "24",
                 "--eval-every", "12", "--n-layer", "2", "--seq-len", "64", "--out-dir", "out",
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    log = json.loads((tmp_path / "out" / "log.json").read_text())
    assert log["args"]["alibi"]
    losses = [entry["loss"] for entry in log["train"]]
    assert losses[-1] < losses[0] - 1.0
    refused = run(str(ROOT / "examples/train_gpt2.py"), "--alibi", "--attention", "xla",
                  "--steps", "1", cwd=tmp_path)
    assert refused.returncode != 0 and "--alibi" in refused.stderr


@pytest.mark.parametrize("spec", ["global:4,window:8", "prefix:16"])
def test_train_gpt2_with_a_mask_description(tmp_path, spec):
    """--mask global:G,window:W (a jax_sdpa.masks union, causal besides) and prefix:P (a prefix
    LM) train; a malformed description is refused by name."""
    result = run(str(ROOT / "examples/train_gpt2.py"), "--mask", spec, "--steps",
                 "24", "--eval-every", "12", "--n-layer", "2", "--seq-len", "64", "--out-dir",
                 "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    log = json.loads((tmp_path / "out" / "log.json").read_text())
    assert log["args"]["mask"] == spec
    losses = [entry["loss"] for entry in log["train"]]
    assert losses[-1] < losses[0] - 1.0
    refused = run(str(ROOT / "examples/train_gpt2.py"), "--mask",
                  {"global:4,window:8": "stripes:3", "prefix:16": "prefix:4,window:3"}[spec],
                  "--steps", "1", cwd=tmp_path)
    assert refused.returncode != 0 and "--mask" in refused.stderr


def test_packed_rows_follow_their_documents():
    """A packed row's segment ids change exactly where the file changes, positions restart
    there, and no loss crosses a file boundary."""
    sys.path.insert(0, str(ROOT / "examples"))
    import numpy as np  # noqa: PLC0415
    from stdlib_text import DocumentStream  # noqa: PLC0415
    documents = [np.full(n, i, np.uint8) for i, n in enumerate((5, 3, 9, 4))]
    rows = DocumentStream(documents).packed_batch(16, 8, np.random.default_rng(0))
    for tokens, targets, ids, positions, weights in zip(
            rows["tokens"], rows["targets"], rows["segment_ids"], rows["positions"],
            rows["weights"]):
        np.testing.assert_array_equal(ids, tokens)  # document i is all byte i here
        np.testing.assert_array_equal(weights, (targets == tokens).astype(np.float32))
        starts = np.concatenate([[True], ids[1:] != ids[:-1]])
        np.testing.assert_array_equal(positions[starts], 0)
        np.testing.assert_array_equal(np.diff(positions)[~starts[1:]], 1)


def test_packed_rows_keep_their_bound_on_documents():
    """max_documents: every row holds at most that many documents (what train_gpt2 tells
    jax_sdpa), rows are still drawn from many offsets, and without it rows hold more."""
    sys.path.insert(0, str(ROOT / "examples"))
    import numpy as np  # noqa: PLC0415
    from stdlib_text import DocumentStream  # noqa: PLC0415
    documents = [np.full(n, i, np.uint8) for i, n in enumerate((5, 3, 9, 4, 2, 6, 3))]
    stream = DocumentStream(documents)

    def counts(rows):
        ids = rows["segment_ids"]
        return 1 + np.count_nonzero(ids[:, 1:] != ids[:, :-1], axis=1)
    rng = np.random.default_rng(0)
    for bound in (1, 2):
        rows = stream.packed_batch(64, 6, rng, max_documents=bound)
        assert counts(rows).max() <= bound
        if bound > 1:  # (one document per row: two documents are long enough)
            distinct = {(*tokens, *positions)
                        for tokens, positions in zip(rows["tokens"], rows["positions"])}
            assert len(distinct) > 3
    assert counts(stream.packed_batch(64, 6, rng)).max() > 2
    with pytest.raises(ValueError, match="max_documents"):  # no row of 10 fits in one document
        stream.packed_batch(4, 10, rng, max_documents=1)


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
        timeout=600,
        env=dict(os.environ, XLA_FLAGS=env_flags, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
    assert result.returncode == 0, result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("done:")][0]
    first, last = (float(x) for x in line.split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first - 1.0, line


def test_fp8_attention_flag_reaches_the_model():
    """--fp8-attention gives the model jax_sdpa's fp8=True: its logits differ from bf16
    attention's by FP8's rounding (not zero, not more than FP8's error), and the flag is
    refused where FP8 attention takes no part (jax.nn, packed rows)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from gpt2_model import GPT, GPTConfig  # noqa: PLC0415
    from train_gpt2 import parse_args  # noqa: PLC0415
    assert parse_args(["--fp8-attention", "--n-head", "6"]).fp8
    for flags in (["--attention", "xla"], ["--pack"]):
        with pytest.raises(SystemExit):
            parse_args(["--fp8-attention", *flags])
    tokens = np.random.default_rng(0).integers(0, 256, (2, 48), dtype=np.int32)
    logits = {}
    for fp8 in (False, True):
        config = GPTConfig(seq_len=48, n_layer=1, n_head=2, d_model=64, dtype="float32", fp8=fp8)
        logits[fp8] = np.asarray(jax.jit(lambda x, m=GPT(config, nnx.Rngs(0)): m(x))(tokens))
    error = np.linalg.norm(logits[True] - logits[False]) / np.linalg.norm(logits[False])
    assert 1e-4 < error < 0.1, error


def test_step_log_times_each_step_from_the_loss_before(monkeypatch):
    """train_gpt2.StepLog: a step's time runs from the previous loss read (or the clock's
    restart) to its own; tokens/s leaves out the first two steps (they compile)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import time  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import train_gpt2  # noqa: PLC0415
    clock = iter([0.0, 5.0, 6.0, 6.5, 7.0, 7.25])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    log = train_gpt2.StepLog()
    assert log.tokens_per_s is None
    for step, tokens in ((1, 10), (2, 20), (3, 30)):
        log.read(step, np.float32(3.5 - step), tokens)
    log.restart_clock()  # an evaluation's time is no step's
    log.read(4, np.float32(0.25), 40)
    assert [entry["seconds"] for entry in log.history] == [5.0, 1.0, 0.5, 0.25]
    assert [entry["loss"] for entry in log.history] == [2.5, 1.5, 0.5, 0.25]
    assert all(type(entry["loss"]) is float for entry in log.history)
    assert log.tokens_per_s == (30 + 40) / 0.75


def test_step_log_reads_each_step_once_the_next_is_dispatched(monkeypatch):
    """StepLog.dispatched reads the step dispatched before (not the new one); flush reads the
    last one; after the second step the collector's objects are frozen."""
    sys.path.insert(0, str(ROOT / "examples"))
    import gc  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import train_gpt2  # noqa: PLC0415
    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    log = train_gpt2.StepLog()
    log.dispatched(1, np.float32(2.0), 10)
    assert log.history == [] and not frozen
    log.dispatched(2, np.float32(1.5), 10)
    assert [entry["step"] for entry in log.history] == [1] and frozen == [True]
    log.flush()
    log.flush()  # nothing left to read
    assert [entry["step"] for entry in log.history] == [1, 2]
    assert [entry["loss"] for entry in log.history] == [2.0, 1.5]

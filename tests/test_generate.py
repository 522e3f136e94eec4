"""The GPT-2 example's paged decoding (examples/gpt2_model.py GPT.decode: jax_sdpa's
paged_kv_update + paged_attention) gives the logits of the full forward pass: prefill of
left-padded prompts of different lengths, then one token at a time; and examples/generate.py
runs on what examples/train_gpt2.py saved."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from gpt2_model import GPT, GPTConfig  # noqa: E402
from generate import page_table  # noqa: E402


@pytest.mark.parametrize("variants", [{}, dict(logits_soft_cap=3.0, sinks=True)],
                         ids=["plain", "soft_cap+sinks"])
def test_paged_decode_gives_the_full_forward_logits(variants):
    config = GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=32, dtype="float32",
                       **variants)
    model = GPT(config, nnx.Rngs(1))
    if config.sinks:  # nonzero sinks, so that they matter
        for block in model.blocks:
            block.attn.sinks[...] = jnp.linspace(-1.0, 2.0, config.n_head)
    rng = np.random.default_rng(0)
    lengths = np.array([9, 14, 5], np.int32)
    steps = 4
    tokens = rng.integers(0, 256, size=(3, lengths.max() + steps)).astype(np.int32)
    table = page_table(3, 24, 4, 40, rng)
    caches = [tuple(jnp.zeros((40, 4, 4, 8)) for _ in range(2)) for _ in range(2)]
    width = int(lengths.max())
    padded = np.zeros((3, width), np.int32)
    for row, n in enumerate(lengths):
        padded[row, width - n:] = tokens[row, :n]
    graphdef, state = nnx.split(model)  # jitted, as examples/generate.py runs it

    @jax.jit
    def decode(state, tokens, caches, start):
        return nnx.merge(graphdef, state).decode(tokens, caches, table, start)

    @jax.jit
    def forward(state, tokens):
        return nnx.merge(graphdef, state)(tokens)
    with jax.default_matmul_precision("float32"):
        logits, caches = decode(state, jnp.asarray(padded), caches, jnp.asarray(lengths - width))
        decoded = [logits[:, -1]]
        for i in range(steps):
            next_tokens = tokens[np.arange(3), lengths + i][:, None]
            logits, caches = decode(state, jnp.asarray(next_tokens), caches,
                                    jnp.asarray(lengths + i))
            decoded.append(logits[:, 0])
        for row, n in enumerate(lengths):
            full = forward(state, jnp.asarray(tokens[row:row + 1, :n + steps]))[0]
            for i, step_logits in enumerate(decoded):
                np.testing.assert_allclose(step_logits[row], full[n - 1 + i], rtol=1e-4,
                                           atol=1e-4)


def test_generate_runs_on_a_trained_run(tmp_path):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    train = subprocess.run([sys.executable, str(ROOT / "examples/train_gpt2.py"), "--steps", "6",
                            "--eval-every", "6", "--n-layer", "2", "--seq-len", "128",
                            "--out-dir", "runs/tiny"], cwd=tmp_path, capture_output=True,
                           text=True, env=env, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    assert (tmp_path / "runs/tiny/params.npz").exists()
    result = subprocess.run([sys.executable, str(ROOT / "examples/generate.py"), "--new-tokens",
                             "12", "--prompts", "3"], cwd=tmp_path, capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tokens/s decoding" in result.stdout and result.stdout.count(" -> ") == 3
    assert json.loads((tmp_path / "runs/tiny/log.json").read_text())["args"]["n_layer"] == 2

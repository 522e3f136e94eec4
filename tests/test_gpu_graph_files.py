"""Graphs kept on disk across processes (JAX_SDPA_GRAPH_CACHE_DIR): a second process loads the
first one's forward and backward graphs instead of building them and gets the same answers;
garbage written over the files is rejected, the graphs are built and written again. Each run is
a fresh Python process. Skipped without a GPU."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = """
import json, jax, jax.numpy as jnp, numpy as np, jax_sdpa
keys = jax.random.split(jax.random.key(0), 4)
q, k, v, d_out = (jax.random.normal(x, (2, 256, 4, 64), jnp.float32).astype(jnp.bfloat16)
                  for x in keys)
f = lambda q, k, v: jax_sdpa.dot_product_attention(q, k, v, is_causal=True,
                                                   implementation="cudnn")
out, vjp = jax.vjp(f, q, k, v)
results = [np.asarray(x, np.float32) for x in (out, *vjp(d_out))]
print(json.dumps(dict(stats=jax_sdpa.graph_cache_stats(),
                      sums=[float(np.abs(x).sum()) for x in results])))
"""


def run(directory):
    env = dict(os.environ, JAX_SDPA_GRAPH_CACHE_DIR=str(directory))
    result = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True,
                            cwd=ROOT, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_graphs_load_from_disk_in_a_new_process(tmp_path):
    first = run(tmp_path)
    assert first["stats"]["builds"] == 2  # forward and backward
    assert first["stats"]["disk_writes"] == 2 and first["stats"]["disk_loads"] == 0
    files = sorted(tmp_path.glob("*.cudnn-graph"))
    assert len(files) == 2
    second = run(tmp_path)
    assert second["stats"]["builds"] == 0 and second["stats"]["disk_loads"] == 2
    assert second["sums"] == first["sums"]
    for path in files:  # garbage in every file: rejected, rebuilt, rewritten
        path.write_bytes(os.urandom(path.stat().st_size))
    third = run(tmp_path)
    assert third["stats"]["disk_rejects"] == 2
    assert third["stats"]["builds"] == 2 and third["stats"]["disk_writes"] == 2
    assert third["sums"] == first["sums"]
    assert run(tmp_path)["stats"]["disk_loads"] == 2

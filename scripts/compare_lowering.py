"""Whether this checkout lowers the same programs for CUDA as another commit: a refactor whose
lowered programs are unchanged runs on the GPU as the programs the GPU suite last passed, so it
needs no GPU to be trusted. Runs on a CPU-only machine.

    python scripts/compare_lowering.py COMMIT [--keep DIR]

Lowers a fixed set of calls (dense, windows, soft-cap, packed, stated bound, dropout, bias,
mask, lengths, sinks, fp8=True, bottom-right, paged, jax_sdpa.fp8), forward and backward, in a
worktree of COMMIT and here, with the extension built here (only its target names matter when
lowering), and prints the first differing lines of each call that differs. Exit status 0 when
every call lowers identically, 1 otherwise.
"""

from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]

# Run in a child process whose jax_sdpa is the tree at sys.argv[1] (for another tree, the
# editable install's import hook is removed first): prints each case's lowered text, after a
# marker line.
_LOWER = r'''
import sys
if sys.argv[2] == "other":
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import jax, jax.numpy as jnp
import jax_sdpa
from jax_sdpa.cudnn import extension as _extension
from jax_sdpa.limits import device
device.device_reason = lambda: None
_extension.cudnn_version = lambda: 91900
B, T, S, N, K, H = 2, 64, 96, 4, 2, 64
q = jnp.zeros((B, T, N, H), jnp.bfloat16)
kv = jnp.zeros((B, S, K, H), jnp.bfloat16)
ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), T // 4)[None].repeat(B, 0)
lengths = jnp.array([50, 64], jnp.int32)
dense = {
    "causal": dict(is_causal=True), "window+soft_cap": dict(local_window_size=(5, 3),
                                                            logits_soft_cap=30.0),
    "packed": dict(is_causal=True, query_segment_ids=ids),
    "stated": dict(is_causal=True, query_segment_ids=ids, max_document_length=16,
                   max_segments=4),
    "dropout": dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    "bias": dict(bias=jnp.zeros((1, N, T, T), jnp.bfloat16), deterministic=True),
    "mask": dict(mask=jnp.ones((B, 1, T, T), bool), is_causal=True),
    "lengths": dict(query_seq_lengths=lengths, key_value_seq_lengths=lengths, is_causal=True),
    "sinks": dict(sinks=jnp.zeros((N,), jnp.float32), is_causal=True),
    "fp8": dict(fp8=True, is_causal=True),
}
cross = {"bottom_right causal": dict(is_causal=True, causal_alignment="bottom_right"),
         "bottom_right window": dict(local_window_size=8, causal_alignment="bottom_right")}

def lowered(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

def grad_of(keys, values, options):
    return jax.grad(lambda q: jax_sdpa.dot_product_attention(
        q, keys, values, implementation="cudnn", **options).astype(jnp.float32).sum())

texts = {name: lowered(grad_of(q, q, options), q) for name, options in dense.items()}
texts.update({name: lowered(grad_of(kv, kv, options), q) for name, options in cross.items()})
cache = jnp.zeros((24, 16, K, H), jnp.bfloat16)
table = jnp.zeros((B, 6), jnp.int32)
for name, t, options in (("paged decode", 1, {}), ("paged prefill window", 4,
                                                   dict(local_window_size=(4, 0)))):
    texts[name] = lowered(lambda q: jax_sdpa.paged_attention(
        q, cache, cache, table, lengths, implementation="cudnn", **options),
        jnp.zeros((B, t, N, H), jnp.bfloat16))
from jax_sdpa import fp8
from fp8_params import quantized_problem
shape = (B, 128, N, 128)
q8, k8, v8, d8, params, _ = quantized_problem(*(jnp.ones(shape, jnp.float32),) * 4,
                                              causal=True, scale=0.1)

def framework(q8, k8, v8, params):
    out, vjp = jax.vjp(lambda *a: fp8.dot_product_attention(
        *a[:3], fp8_params=a[3], scale=0.1, mask_type="CAUSAL")[0], q8, k8, v8, params)
    return out, vjp(d8)
texts["jax_sdpa.fp8"] = lowered(framework, q8, k8, v8, params)
for name, text in texts.items():
    print(f"@@@@ {name}")
    print(text)
'''


def lower_in(tree: pathlib.Path) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    which = "here" if tree == REPO else "other"
    result = subprocess.run([sys.executable, "-c", _LOWER, str(tree), which], capture_output=True,
                            text=True, env=env, check=False)
    if result.returncode:
        sys.exit(f"lowering in {tree} failed:\n{result.stderr[-3000:]}")
    cases, name = {}, None
    for line in result.stdout.splitlines():
        if line.startswith("@@@@ "):
            name = line[5:]
            cases[name] = []
        elif name is not None:
            cases[name].append(line)
    return cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit")
    parser.add_argument("--keep", default=None, help="put the worktree here and keep it")
    args = parser.parse_args(argv)
    import jax_sdpa._sdpa_ffi as extension  # noqa: PLC0415 - this checkout's build
    with tempfile.TemporaryDirectory() as scratch:
        tree = pathlib.Path(args.keep or scratch) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(tree),
                        args.commit], check=True, capture_output=True)
        try:
            (tree / "jax_sdpa" / pathlib.Path(extension.__file__).name).write_bytes(
                pathlib.Path(extension.__file__).read_bytes())
            theirs, ours = lower_in(tree), lower_in(REPO)
        finally:
            if not args.keep:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(tree)], check=False, capture_output=True)
    differing = 0
    for name in ours:
        if theirs.get(name) == ours[name]:
            print(f"same       {name}")
            continue
        differing += 1
        print(f"DIFFERENT  {name}")
        diff = difflib.unified_diff(theirs.get(name, []), ours[name], args.commit, "here",
                                    lineterm="", n=0)
        for line in list(diff)[:12]:
            print("    " + line[:220])
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())

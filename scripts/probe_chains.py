"""The chains of issue #72 on the GPU, with and without the barriers around our FFI calls.

    python3 scripts/probe_chains.py

8 forward calls with `prefix_lm(2048)` and 4 chained vjps with `sliding_window(2048, 2048)`
(B = 1, T = S = 8192, 16 heads of 128, bfloat16) in one jit each: with the barriers
(`jax_sdpa/cudnn/call._apart`) they compile and run; with them replaced by the identity,
XLA's dynamic-slice fusion failed inside XLA on JAX 0.11.2 (docs/DEVELOPING.md, "Our calls
kept apart from XLA's slices"). Prints one line per chain and setting.
"""

import jax
import jax.numpy as jnp

import jax_sdpa
from jax_sdpa import masks
from jax_sdpa.cudnn import call


def forwards(k, v):
    def chain(q):
        for _ in range(8):
            q = jax_sdpa.dot_product_attention(q, k, v, mask=masks.prefix_lm(2048))
        return q
    return chain


def vjps(q, k, v):
    attend = lambda q, k, v: jax_sdpa.dot_product_attention(  # noqa: E731
        q, k, v, mask=masks.sliding_window(2048, 2048))
    for _ in range(4):
        _, pullback = jax.vjp(attend, q, k, v)
        q, k, v = pullback(q)
    return q, k, v


def main():
    barriers = call._apart
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 8192, 16, 128), jnp.bfloat16)
               for i in range(3))
    for kept in (False, True):
        call._apart = barriers if kept else (lambda values: list(values))
        jax.clear_caches()
        for name, fn, args in (("8 forwards, prefix_lm", forwards(k, v), (q,)),
                               ("4 vjps, two-sided window", vjps, (q, k, v))):
            try:
                jax.block_until_ready(jax.jit(fn)(*args))
                outcome = "ran"
            except Exception as error:  # noqa: BLE001 - what XLA raised is the finding
                outcome = f"{type(error).__name__}: {str(error)[:300]}"
            print(f"barriers={kept} {name}: {outcome}", flush=True)
    call._apart = barriers


if __name__ == "__main__":
    main()

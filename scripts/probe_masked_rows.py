"""Probe (GPU): what cuDNN returns for query rows that see no key at all, next to the reference
path (jax.nn's semantics: a uniform average of the values). Prints, does not assert: the
answer decides what the README promises for such rows."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa

q, k, v = (jax.random.normal(jax.random.key(i), (2, 64, 4, 64), jnp.float32).astype(jnp.bfloat16)
           for i in range(3))
mask = np.ones((2, 1, 64, 64), bool)
mask[0, :, 5, :] = False  # row 5 of batch 0 sees nothing
cases = {"mask row": dict(mask=jnp.asarray(mask)),
         "kv length 0": dict(key_value_seq_lengths=jnp.array([0, 64], jnp.int32))}
for name, kwargs in cases.items():
    row = (0, 5) if name == "mask row" else (0, 0)
    outs = {impl: jax_sdpa.dot_product_attention(q, k, v, implementation=impl, **kwargs)
            for impl in ("cudnn", "xla")}
    for impl, out in outs.items():
        values = np.asarray(out[row[0], row[1], 0, :4], np.float32)
        print(f"{name:12s} {impl:6s} row {row}: {values}")
    print(f"{name:12s} mean of v       : {np.asarray(v[0, :, 0, :4].astype(jnp.float32).mean(0))}")

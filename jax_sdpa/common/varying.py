"""Inside shard_map: the mesh axes a value varies over, and our FFI calls' results marked
varying like their operands (ffi_call leaves them unmarked)."""

from __future__ import annotations

import jax


def varying_like(results, operands):
    """Inside shard_map, marks our results as varying over every mesh axis an operand varies
    over (ffi_call leaves them unmarked), so they type-check like any other per-device value
    (lax.switch branches, out_specs)."""
    axes = set()
    for x in operands:
        axes |= varying_axes(x)
    if not axes:
        return tuple(results)

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)  # JAX < 0.9
    return tuple(cast(x) for x in results)


def varying_axes(x) -> set:
    """The manual mesh axes x varies over (JAX >= 0.10 keeps them in aval.mat.varying, earlier
    releases in aval.vma)."""
    aval = jax.typeof(x)
    varying = getattr(getattr(aval, "mat", None), "varying", None)
    if varying is None:
        varying = getattr(aval, "vma", ())
    return set(varying or ())

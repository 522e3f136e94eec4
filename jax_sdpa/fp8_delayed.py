"""Delayed scaling for jax_sdpa.fp8.dot_product_attention (JAX's use_fp8 convention), as
TransformerEngine's DelayedScaling recipe and Flax's FP8 ops keep it: each FP8 tensor's scale
comes from the largest amax of its last `length` steps, so this step's tensors are quantized
with what earlier steps measured and no amax has to be reduced before quantizing; this step's
amaxes (the call hands back those of P, O, dS and the gradients; `quantize` gives those of the
inputs) enter the history for the next. A tensor that outgrows its history saturates at the
format's largest value until the history catches up; `margin` leaves 2^margin of headroom.
An empty history (the first step) scales by 1. Everything is e4m3, as the convention's tensors.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_sdpa.reference import fp8_scaling as scaling

# The tensors with a history: the inputs and the output cotangent (quantized by the caller),
# the softmax weights P ("s"), the output, dS ("dP", JAX's name) and the gradients.
TENSORS = ("q", "k", "v", "dO", "s", "o", "dP", "dQ", "dK", "dV")
_FORMAT = "e4m3"


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """length: steps of amax history per tensor; margin: scales leave 2^margin of headroom."""

    length: int = 16
    margin: float = 0.0

    def __post_init__(self):
        if not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"length must be a positive int, got {self.length!r}")

    def init(self) -> dict:
        """An empty history: float32 [length] of zeros per tensor (TENSORS)."""
        return {name: jnp.zeros((self.length,), jnp.float32) for name in TENSORS}

    def scale(self, history: dict, name: str):
        """float32 scalar: the format's largest value over the history's largest amax (times
        2^margin), or 1 while the history holds none."""
        amax = jnp.max(history[name])
        headroom = amax * 2.0 ** self.margin
        return jnp.where(amax > 0, scaling.largest(_FORMAT) / jnp.where(amax > 0, headroom, 1.0),
                         1.0)

    def quantize(self, history: dict, name: str, x):
        """(x in float8_e4m3fn with its tensor's delayed scale, x's amax for `update`)."""
        return (scaling.quantize(x, self.scale(history, name), _FORMAT),
                jnp.max(jnp.abs(x.astype(jnp.float32))))

    def fp8_params(self, history: dict) -> dict:
        """jax_sdpa.fp8.dot_product_attention's fp8_params from the history: the inputs'
        descales, the scales (and descales) of P, O and dS, the gradients' scales, and the
        amax placeholders whose cotangents are the backward's amaxes."""
        s = {name: self.scale(history, name) for name in TENSORS}
        params = {f"descale_{name}": 1 / s[name] for name in ("q", "k", "v", "dO")}
        for name in ("s", "o", "dP"):
            params[f"scale_{name}"], params[f"descale_{name}"] = s[name], 1 / s[name]
        for name in ("dQ", "dK", "dV"):
            params[f"scale_{name}"] = s[name]
        params.update({f"amax_{name}": jnp.zeros(()) for name in ("dQ", "dK", "dV", "dP")})
        return {name: scaling.scalar(value) for name, value in params.items()}

    def update(self, history: dict, amaxes: dict) -> dict:
        """The history one step on: each tensor named in amaxes (a scalar each) gets it as its
        newest entry, the oldest dropped; the others stay."""
        unknown = set(amaxes) - set(TENSORS)
        if unknown:
            raise ValueError(f"amaxes of unknown tensors {sorted(unknown)}; known: {TENSORS}")
        return {name: (jnp.roll(h, 1).at[0].set(jnp.asarray(amaxes[name], jnp.float32)
                                                  .reshape(()))
                       if name in amaxes else h)
                for name, h in history.items()}

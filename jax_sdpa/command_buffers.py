"""Whether a call's FFI target is one XLA may record into its command buffers (CUDA graphs):
JAX_SDPA_COMMAND_BUFFERS, else by the call's work."""

from __future__ import annotations

import os

COMMAND_BUFFERS_VARIABLE = "JAX_SDPA_COMMAND_BUFFERS"
# By default a call is recorded into XLA's command buffers (CUDA graphs) when its work is at
# most this many FLOPs (2 * query rows * keys * (H + Hv), masks ignored): ~0.1 ms of kernel time
# or less on an H200, where launching and dispatching are a visible share of a call. Above it
# recording gained nothing measurable (benchmarks.attention, benchmarks.plans), so larger calls
# keep the plain targets.
# Either way the workspace is XLA's (_call_with_workspace), so a recorded call holds no memory.
COMMAND_BUFFER_MAX_FLOPS = 2 ** 36


def command_buffers() -> bool | None:
    """Whether our calls use the FFI targets XLA may record into its command buffers:
    JAX_SDPA_COMMAND_BUFFERS=1 all of them, =0 none, unset None (each call by its work,
    COMMAND_BUFFER_MAX_FLOPS); read when a call is traced."""
    text = os.environ.get(COMMAND_BUFFERS_VARIABLE, "")
    if text not in ("", "0", "1"):
        raise ValueError(f"{COMMAND_BUFFERS_VARIABLE} must be 0 or 1, got {text!r}")
    return None if not text else text == "1"


def call_flops(query, keys: int, head_dim_v: int) -> float:
    """A call's work as if dense: 2 * query rows * keys * (H + Hv) (Q K^T and P V)."""
    rows = 1
    for size in query.shape[:-1]:
        rows *= int(size)
    return 2.0 * rows * keys * (int(query.shape[-1]) + head_dim_v)


def records_into_command_buffers(config, flops: float) -> bool:
    """The mode a call with this config and work runs in (command_buffers())."""
    if config.command_buffer is not None:
        return config.command_buffer
    return flops <= COMMAND_BUFFER_MAX_FLOPS

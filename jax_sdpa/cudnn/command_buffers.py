"""Whether our calls use the FFI targets XLA may record into its command buffers (CUDA graphs):
JAX_SDPA_COMMAND_BUFFERS=1 all of them (but a checked packed call's ragged call, which waits for
the grid the device chose: jax_sdpa/packing/ragged.py), unset or 0 none.

Not recording is the default because a recorded call costs host time on every run whose
buffers moved (a training step's always do): XLA updates the command buffer by capturing the
call again. Recording the 24 calls of GPT-2 small's training step (~0.1 ms each) made the step
~5 ms (~20%) slower, the GPU waiting for the host's updates (docs/PERFORMANCE.md, Training); a
plain call costs one cuDNN launch. Recording can only save that launch (microseconds), in a
chain whose buffers stay where they were.
"""

from __future__ import annotations

import os

COMMAND_BUFFERS_VARIABLE = "JAX_SDPA_COMMAND_BUFFERS"


def command_buffers() -> bool:
    """Whether calls traced now use our command-buffer targets: JAX_SDPA_COMMAND_BUFFERS=1."""
    text = os.environ.get(COMMAND_BUFFERS_VARIABLE, "")
    if text not in ("", "0", "1"):
        raise ValueError(f"{COMMAND_BUFFERS_VARIABLE} must be 0 or 1, got {text!r}")
    return text == "1"

"""What cuDNN's paged forward takes: cuDNN 9.5 (9.10 for head dims past 128 and for a window
on one query per sequence), the dense kernels' dtypes and head dims, no soft-cap."""

from __future__ import annotations

from jax_sdpa.cudnn import extension
from jax_sdpa.limits import dense, device

MIN_PAGED_CUDNN_VERSION = 90500  # cuDNN 9.5: page tables for K/V in the SDPA forward
PAGED_WIDE_HEADS_CUDNN_VERSION = 91000  # head dims past 128 with paged K/V: cuDNN 9.10
DECODE_WINDOW_CUDNN_VERSION = 91000  # a band on a single query row (s_q = 1): cuDNN 9.10


def paged_reason(dtype, head_dim, head_dim_v, logits_soft_cap, decoding_window) -> str | None:
    """None if cuDNN's paged forward can run this paged_attention call on this device, else
    why not. decoding_window: one query per sequence with a window (a band on a single query
    row, which cuDNN before 9.10 refuses)."""
    reason = device.device_reason() or dense.kernel_reason(
        dtype, (("head_dim", head_dim), ("value head_dim", head_dim_v)))
    if reason:
        return reason
    version = extension.cudnn_version()
    if version < MIN_PAGED_CUDNN_VERSION:
        return f"cuDNN's paged K/V needs cuDNN >= 9.5 (the loaded cuDNN is {version})"
    if max(head_dim, head_dim_v) > 128 and version < PAGED_WIDE_HEADS_CUDNN_VERSION:
        return (f"cuDNN's paged K/V takes head dims up to 128 before cuDNN 9.10 (got {head_dim} "
                f"and {head_dim_v}; the loaded cuDNN is {version})")
    if decoding_window and version < DECODE_WINDOW_CUDNN_VERSION:
        return (f"a local_window_size with one query per sequence needs cuDNN >= 9.10 (the "
                f"loaded cuDNN is {version})")
    if logits_soft_cap is not None:
        return "logits_soft_cap is not built into jax_sdpa's paged cuDNN graph yet"
    return None

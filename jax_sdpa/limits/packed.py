"""What cuDNN's ragged layout takes for packed segment ids (else they become a dense
[B, 1, T, S] bias): Hopper or newer, no bias, mask, soft-cap or bottom-right band beside them,
int32 offsets, and cuDNN 9.9 for a checked call's exact fallback."""

from __future__ import annotations

from jax_sdpa.limits import device

MIN_RAGGED_COMPUTE_CAPABILITY = (9, 0)  # cuDNN's ragged (packed) layout: Hopper and newer
# cuDNN 9.9: a document mask from segment ids inside the score modifier (the checked packed
# call's exact fallback, jax_sdpa/packing/fallback.py)
MIN_SEGMENT_MASK_CUDNN_VERSION = 90900
_INT32_LIMIT = 2 ** 31  # ragged offsets are int32 element counts


def ragged_reason(call) -> str | None:
    """None if the validated call's segment ids can run on cuDNN's ragged (packed) layout, else
    why they take the dense path (a [B, 1, T, S] bias)."""
    if call.bias is not None or call.mask is not None:
        return "segment ids with a bias or mask need a dense [B, N, T, S] bias"
    if call.spec.logits_soft_cap:
        return ("segment ids with logits_soft_cap need a dense [B, 1, T, S] bias (cuDNN's "
                "ragged layout relies on its built-in padding mask, which a score modifier "
                "turns off)")
    if call.spec.bottom_right:
        return ("segment ids with causal_alignment='bottom_right' and T != S need a dense "
                "[B, 1, T, S] bias")
    capability = device.gpu_capability()
    if capability is not None and capability < MIN_RAGGED_COMPUTE_CAPABILITY:
        return ("cuDNN's ragged layout for segment ids needs compute capability 9.0 (Hopper) "
                "or newer; using a dense [B, 1, T, S] bias")
    version = device.gpu_cudnn_version()
    if (not call.spec.max_document_length and version is not None and
            version < MIN_SEGMENT_MASK_CUDNN_VERSION):
        return (f"segment ids without max_document_length need cuDNN >= 9.9 for their exact "
                f"fallback (the loaded cuDNN is {version}); using a dense [B, 1, T, S] bias")
    batch, q_seq_len, q_heads, head_dim = call.query.shape
    _, kv_seq_len, kv_heads, _ = call.key.shape
    head_dim_v = call.value.shape[-1]
    largest = max(batch * q_seq_len * q_heads * max(head_dim, head_dim_v),
                  batch * kv_seq_len * kv_heads * max(head_dim, head_dim_v))
    if largest >= _INT32_LIMIT:
        return (f"a tensor of {largest} elements is past the int32 offsets of cuDNN's ragged "
                "layout; using a dense [B, 1, T, S] bias")
    return None

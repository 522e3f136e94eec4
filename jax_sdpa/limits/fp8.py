"""What FP8 attention takes, in one place: the options (is_causal top-left, sequence lengths,
GQA/MQA; nothing else, what cuDNN's FP8 graphs run), and the sizes and devices cuDNN's FP8
forward and backward run (elsewhere the FP8 reference computes the same roundings)."""

from __future__ import annotations

from jax_sdpa.cudnn import extension
from jax_sdpa.limits import device

MAX_HEAD_DIM = 256
MIN_FP8_CUDNN_VERSION = 90100  # cuDNN's FP8 SDPA graphs, forward and backward
BROKEN_FP8_CUDNN_VERSION = 91000  # the frontend refuses FP8 SDPA on exactly cuDNN 9.10.0
MIN_FP8_COMPUTE_CAPABILITY = (9, 0)  # Hopper: FP8 tensor cores
MIN_FP8_BACKWARD_SEQ_LEN = 64


# What FP8 attention takes beside Q, K, V: the scale, the causal mask (top-left), sequence
# lengths (and max_segments, which only packed rows read).
_TAKEN = ("scale", "is_causal", "fp8", "max_segments", "query_seq_lengths",
          "key_value_seq_lengths")
# An option at one of these values is not given.
_NOT_GIVEN = (None, False, 0.0, "top_left")


def options_reason(options: dict, *, subject="fp8=True") -> str | None:
    """None if FP8 attention takes these options ({name: value}; None, False, 0 or "top_left"
    means not given), else why not, naming each it does not take."""
    refused = [name for name, value in options.items() if name not in _TAKEN and
               not any(value is default or (type(value) is type(default) and value == default)
                       for default in _NOT_GIVEN)]
    if refused:
        return (f"{subject} takes is_causal (top-left) and sequence lengths, not "
                f"{', '.join(refused)}")
    return None


def fp8_reason(head_dim, head_dim_v, q_seq_len, kv_seq_len) -> str | None:
    """None if cuDNN's FP8 forward runs these sizes on this device, else why not."""
    if head_dim != head_dim_v or head_dim % 16 or head_dim > MAX_HEAD_DIM:
        return (f"cuDNN's FP8 attention takes equal query and value head dims, multiples of 16 "
                f"up to {MAX_HEAD_DIM} (got {head_dim} and {head_dim_v})")
    if q_seq_len == 1:
        # Measured on an H200 with cuDNN 9.19: "No valid engine configs" for S = 1 to 1024.
        return f"cuDNN's FP8 forward has no engine for a single query (T = 1, S = {kv_seq_len})"
    if device.device_reason() is not None:
        return None
    capability = device.capability()
    if capability is not None and capability < MIN_FP8_COMPUTE_CAPABILITY:
        return (f"cuDNN's FP8 attention needs compute capability 9.0 (Hopper) or newer (got "
                f"{capability[0]}.{capability[1]})")
    version = extension.cudnn_version()
    if version < MIN_FP8_CUDNN_VERSION or version == BROKEN_FP8_CUDNN_VERSION:
        return (f"cuDNN's FP8 attention needs cuDNN >= 9.1, not 9.10.0 (the loaded cuDNN is "
                f"{version})")
    return None


# Whether an FP8 call may take cuDNN's half-precision backward (half_backward_reason); its
# accuracy is held by tests/test_gpu_fp8.py::test_half_backward*.
HALF_BACKWARD_ON_CUDNN = True


def half_backward_reason(q_heads, kv_heads, fp8_backward: str | None) -> str | None:
    """Why an FP8 call's backward runs on cuDNN's half-precision graphs (in the inputs' dtype,
    from the FP8 forward's output and stats) rather than its FP8 graphs, or None. Given
    fp8_backward_reason's answer; the caller has checked that the half-precision backward
    runs."""
    if not HALF_BACKWARD_ON_CUDNN:
        return None
    if fp8_backward is not None:
        return fp8_backward
    if kv_heads < q_heads:
        # Measured on an H200, cuDNN 9.19 (docs/PERFORMANCE.md, "FP8"): with GQA the FP8
        # backward took 7.7 ms against 5.6 ms in bfloat16 (gqa-s8k), 30.1 against 21.5 ms
        # (llama3.1-s16k); without GQA it is the faster one.
        return "cuDNN's FP8 backward is slower than its bfloat16 one with GQA"
    return None


def fp8_backward_reason(q_seq_len, kv_seq_len, head_dim) -> str | None:
    """None if cuDNN's FP8 backward takes these sizes on this device, else why not."""
    if min(q_seq_len, kv_seq_len) < MIN_FP8_BACKWARD_SEQ_LEN:
        # Measured on an H200 with cuDNN 9.19: T = S = 7 gave dq 70% off (the frontend's own
        # FP8 tests list short sequences as known mismatches).
        return (f"cuDNN's FP8 backward was wrong below {MIN_FP8_BACKWARD_SEQ_LEN} queries or "
                f"keys on cuDNN 9.19 (T={q_seq_len}, S={kv_seq_len})")
    capability = device.gpu_capability()
    if capability is not None and capability[0] == 9 and head_dim != 128:
        return f"cuDNN's FP8 backward takes head_dim 128 only on Hopper (got {head_dim})"
    if capability is not None and capability[0] >= 10 and head_dim > 128:
        return (f"cuDNN's FP8 backward takes head dims up to 128 on compute capability "
                f"{capability[0]}.{capability[1]} (got {head_dim})")
    return None

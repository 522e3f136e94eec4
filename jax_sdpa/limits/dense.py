"""What cuDNN's dense SDPA graphs take: float16/bfloat16, head dims, the diagonal band,
soft-capping (a score modifier) and the sizes their backward refuses."""

from __future__ import annotations

import jax.numpy as jnp

from jax_sdpa.cudnn import extension
from jax_sdpa.limits import device, packed
from jax_sdpa.score_mod.program import UnsupportedScoreMod, passes_the_gradient_on

CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)
MAX_HEAD_DIM = 256
MIN_SOFT_CAP_CUDNN_VERSION = 90400  # cuDNN 9.4: score modifiers (soft-capping) in SDPA graphs
MIN_SOFT_CAP_BACKWARD_CAPABILITY = (9, 0)  # their backward: Hopper and newer
MAX_SCORE_MOD_TABLES = 32  # a score modifier's tables (ffi/graph/sdpa_config.h)
# A score modifier's pointwise nodes in cuDNN's backward graph (the forward's program, the
# derivative's and their conversions: ScoreModProgram.instructions). Measured on cuDNN 9.19
# (H100): graphs of up to 23 such nodes ran right; 27 (windows per head), 31 (global tokens |
# a window) and 38 (an integer floor division plus a floor remainder) killed the process while
# cuDNN built the backward graph, the forward alone (16) running. Larger ones stay off cuDNN.
MAX_SCORE_MOD_INSTRUCTIONS = 24
MAX_MASKING_SCORE_MOD_KEYS_FOR_ONE_QUERY = 130


def kernel_reason(dtype, head_dims) -> str | None:
    """None if cuDNN's kernels take this dtype and these (name, head_dim) pairs, else why not."""
    if dtype not in CUDNN_DTYPES:
        return f"dtype {dtype} is not float16 or bfloat16"
    for name, head_dim in head_dims:
        if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
            return f"{name} {head_dim} is not a multiple of 8 between 8 and {MAX_HEAD_DIM}"
    return None


def score_mod_reason(call) -> str | None:
    """None if cuDNN can run the validated call's score modifier (score_mod, alibi_slopes) or
    it has none, else why not."""
    if call.score_mod is None:
        return None
    if call.spec.fp8:
        return "score_mod and alibi_slopes do not run on cuDNN's FP8 graphs"
    if device.device_reason() is None and extension.cudnn_version() < MIN_SOFT_CAP_CUDNN_VERSION:
        return (f"score_mod and alibi_slopes need cuDNN >= 9.4 (the loaded cuDNN is "
                f"{extension.cudnn_version()})")
    try:
        program = call.score_mod_program
    except UnsupportedScoreMod as error:
        return str(error)
    if program.by_batch and call.query.shape[0] > 1:
        return ("score_mod reads values that vary with the batch (alibi_slopes [B, N] or an "
                "array indexed by batch): cuDNN's score-modifier graphs read values of the head "
                "alone")
    if not passes_the_gradient_on(program.backward):
        # Measured on cuDNN 9.19 (H100, scripts/fuzz_cudnn.py): where the derivative scaled the
        # gradient (s * -1.9, s * q, s * h, TAB / (1.5 + s * s), ...) or dropped it (a term of
        # the key alone), cuDNN's backward gave non-finite or unwritten gradients; additive
        # modifiers and masks ran right.
        return ("score_mod's derivative is not the incoming gradient itself or masked (the "
                "score plus a term, or -inf where a key is hidden): cuDNN 9.19's score-modifier "
                "backward was measured wrong for modifiers that scale or transform the score")
    if "c-inf" in program.forward and call.query.shape[1] == 1 and (
            call.key.shape[1] > MAX_MASKING_SCORE_MOD_KEYS_FOR_ONE_QUERY):
        # Measured on cuDNN 9.19 (H100, scripts/fuzz_cudnn.py): a score_mod hiding keys gave
        # wrong outputs for one query against 300 keys (right up to 130, and without -inf).
        return (f"score_mod hides keys (-inf) of a single query against more than "
                f"{MAX_MASKING_SCORE_MOD_KEYS_FOR_ONE_QUERY} keys (S={call.key.shape[1]}): "
                f"cuDNN 9.19 was measured wrong there")
    if program.instructions > MAX_SCORE_MOD_INSTRUCTIONS:
        return (f"score_mod becomes {program.instructions} pointwise nodes in cuDNN's backward "
                f"graph (its program and its derivative's); cuDNN's score-modifier graphs are "
                f"run here up to {MAX_SCORE_MOD_INSTRUCTIONS} (27 and more were measured to "
                f"crash cuDNN 9.19 while it built the backward graph)")
    if program.table_count > MAX_SCORE_MOD_TABLES:
        return (f"score_mod reads {program.table_count} values of the batch and head; cuDNN's "
                f"graph takes at most {MAX_SCORE_MOD_TABLES}")
    return None


def soft_cap_reason(logits_soft_cap) -> str | None:
    """None if cuDNN's forward can soft-cap the scores (or there is no cap), else why not."""
    if logits_soft_cap is None or device.device_reason() is not None:
        return None
    if extension.cudnn_version() < MIN_SOFT_CAP_CUDNN_VERSION:
        return (f"logits_soft_cap needs cuDNN >= 9.4 (the loaded cuDNN is "
                f"{extension.cudnn_version()})")
    return None


def backward_reason(q_seq_len, kv_seq_len, head_dim, head_dim_v, logits_soft_cap=None,
                    bias_grad=False, score_mod=False) -> str | None:
    """None if cuDNN's backward takes these sizes on this device, else why not (the limits the
    cuDNN frontend checks when it builds the backward graph, and what we measured wrong)."""
    if q_seq_len == 1 and kv_seq_len == 1:
        return "cuDNN's backward does not support one query and one key (T = S = 1)"
    modifier = ("logits_soft_cap" if logits_soft_cap is not None else
                "score_mod" if score_mod else None)
    if modifier and bias_grad:
        # Measured on an H200 with cuDNN 9.19 under soft-capping: dq, dk, dv right, dbias not.
        return (f"cuDNN's bias gradient under {modifier} (a score modifier) was wrong on "
                f"cuDNN 9.19")
    capability = device.gpu_capability()
    if modifier and capability is not None and capability < MIN_SOFT_CAP_BACKWARD_CAPABILITY:
        return (f"cuDNN's backward with {modifier} needs compute capability 9.0 or newer "
                f"(got {capability[0]}.{capability[1]})")
    if capability is None or capability[0] == 9:
        return None
    if capability[0] == 10 and (head_dim, head_dim_v) == (192, 128):
        return None
    if max(head_dim, head_dim_v) > 128:
        return (f"cuDNN's backward takes head dims up to 128 on compute capability "
                f"{capability[0]}.{capability[1]} (got {head_dim} and {head_dim_v})")
    return None


def diagonal_band(call) -> tuple[dict | None, str | None]:
    """(the band cuDNN runs for this validated call, as CallSpec fields, None) or (None, why
    cuDNN cannot run it).

    A bottom-right band is shifted onto the top-left diagonal where the shifted bounds stay
    valid (this also works with a bias and dropout, which cuDNN's own bottom-right alignment
    refuses); otherwise cuDNN's bottom-right alignment is used where it applies."""
    spec = call.spec
    left, right = spec.window_left, spec.window_right
    if not spec.banded:
        return dict(window_left=-1, window_right=-1, bottom_right=False), None
    q_seq_len = call.query.shape[1]
    kv_seq_len = call.key.shape[1]
    offset = call.diagonal_offset
    shifted_left = left - offset if left >= 0 else -1
    shifted_right = right + offset if right >= 0 else -1
    if (left < 0 or shifted_left >= 0) and (right < 0 or shifted_right >= 0):
        band = dict(window_left=shifted_left, window_right=shifted_right, bottom_right=False)
    elif (call.bias is None and call.mask is None and spec.dropout == 0.0 and
          not spec.has_lengths and not spec.segments and q_seq_len <= kv_seq_len):
        band = dict(window_left=left, window_right=right, bottom_right=True)
    else:
        return None, ("causal_alignment='bottom_right' with these sequence lengths "
                      f"(T={q_seq_len}, S={kv_seq_len}) and window needs a band cuDNN does not "
                      "offer together with a bias, mask, dropout, segment ids or sequence "
                      "lengths")
    if band["window_left"] >= 0 and q_seq_len > kv_seq_len and not spec.has_lengths and not (
            spec.segments and packed.ragged_reason(call) is None):
        return None, (f"cuDNN's sliding window needs T <= S without sequence lengths (T="
                      f"{q_seq_len}, S={kv_seq_len})")
    return band, None

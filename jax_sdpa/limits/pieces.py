"""When a mask description runs as pieces (jax_sdpa/pieces/): the options a piece takes (the
scale, soft-capping, sinks, GQA; not a bias or mask array, lengths, segment ids, dropout, a
score_mod or FP8, whose positions or arrays a piece would have to cut too), and each piece's
sizes as our dense kernels take them."""

from __future__ import annotations

from jax_sdpa.limits import dense


def call_reason(call) -> str | None:
    """None if a validated call (its mask description aside) may run as pieces, else why."""
    spec = call.spec
    given = [name for name, present in (
        ("bias", call.bias is not None), ("mask array", call.mask is not None),
        ("sequence lengths", spec.has_lengths), ("segment ids", bool(spec.segments)),
        ("dropout", spec.dropout > 0.0), ("score_mod or alibi_slopes", spec.has_score_mod),
        ("fp8", bool(spec.fp8)), ("band of the call's own", spec.banded))
        if present]
    if given:
        return f"pieces take no {', '.join(given)}"
    return None


# A piece's scores (per head) small enough for the reference's backward where cuDNN's refuses
# one (a piece of one query and one key, say).
SMALL_PIECE = 1 << 12


def backward_reason(piece, head_dim, head_dim_v, soft_cap) -> str | None:
    """None if our dense target runs the piece's backward, else why not."""
    return dense.backward_reason(piece.q_stop - piece.q_start, piece.kv_stop - piece.kv_start,
                                 head_dim, head_dim_v, soft_cap or None)


def plan_reason(plan, call) -> str | None:
    """None if every piece of the plan runs, forward and backward (a small piece's backward on
    the reference where cuDNN's refuses it), else why not."""
    head_dim, head_dim_v = call.query.shape[-1], call.value.shape[-1]
    for piece in plan.backward:
        reason = backward_reason(piece, head_dim, head_dim_v, call.spec.logits_soft_cap)
        area = (piece.q_stop - piece.q_start) * (piece.kv_stop - piece.kv_start)
        if reason is not None and area > SMALL_PIECE:
            return f"a piece's backward: {reason}"
    return None

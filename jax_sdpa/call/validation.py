"""Checking and normalising the arrays of dot_product_attention before anything is traced
into C++ (its scalar options are the description's to check: jax_sdpa/call/spec.py): every
problem becomes a ValueError or TypeError that names the argument."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp

from jax_sdpa.call.spec import CallSpec, Operands, describe
from jax_sdpa.limits import fp8 as fp8_limits
from jax_sdpa.reference.attention import alibi, large_negative
from jax_sdpa.score_mod.program import translate

IMPLEMENTATIONS = (None, "xla", "cudnn")


class DtypeError(TypeError, ValueError):
    """An argument of the wrong dtype: a TypeError, and the ValueError that
    jax.nn.dot_product_attention raises for the same input, so code catching either works."""


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One validated call: its description (static) and its operands, folded to rank 4
    ([B, T, N, H] / [B, S, K, H])."""

    spec: CallSpec
    query: jnp.ndarray
    key: jnp.ndarray
    value: jnp.ndarray
    bias: jnp.ndarray | None
    mask: jnp.ndarray | None
    query_seq_lengths: jnp.ndarray | None
    key_value_seq_lengths: jnp.ndarray | None
    output_shape: tuple[int, ...]  # the caller's output shape, restored on the way out
    dropout_rng: jnp.ndarray | None = None  # a single PRNG key when dropout_rate > 0
    # Packed sequences, kept as ids (never a dense mask here): int32 [B, T] and [B, S]; the
    # keys' ids are None when they are the queries' own.
    query_segment_ids: jnp.ndarray | None = None
    kv_segment_ids: jnp.ndarray | None = None
    sinks: jnp.ndarray | None = None  # float [N], one logit per query head
    # score_mod(score, batch, head, q_index, kv_index), ALiBi's included (alibi_slopes), or None
    score_mod: object = None

    @functools.cached_property
    def score_mod_program(self):
        """The score modifier as cuDNN's pointwise programs (score_mod/program.py); raises
        UnsupportedScoreMod naming what cuDNN cannot express."""
        return translate(self.score_mod, masked_fill=large_negative())

    @property
    def diagonal_offset(self) -> int:
        """Query i sits at key i + diagonal_offset (0 top-left, S - T bottom-right)."""
        return self.spec.diagonal_offset(self.query.shape[1], self.key.shape[1])


def _as_array(value, name):
    try:
        return jnp.asarray(value)
    except TypeError as error:
        raise TypeError(f"{name} must be an array, got {type(value).__name__}") from error


def _check_float(array, name):
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype (float16, bfloat16, float32, ...), "
                        f"got {array.dtype}")


def _fold_batch(array, name):
    """[T, N, H] -> [1, T, N, H]; [B1, B2, ..., T, N, H] -> [B1*B2*..., T, N, H]."""
    if array.ndim < 3:
        raise ValueError(f"{name} must have rank 3 ([seq, heads, head_dim]) or more "
                         f"([batch..., seq, heads, head_dim]), got shape {array.shape}")
    return array.reshape((-1, *array.shape[-3:])) if array.ndim != 4 else array


def _broadcastable_4d(array, target, name):
    """Prepends unit axes up to rank 4 and checks that `array` broadcasts to `target`."""
    if array.ndim > 4:
        raise ValueError(f"{name} must have rank <= 4 (broadcastable to [batch, heads, q_seq, "
                         f"kv_seq] = {target}), got shape {array.shape}")
    array = array.reshape((1,) * (4 - array.ndim) + array.shape)
    for axis, (size, wanted) in enumerate(zip(array.shape, target)):
        if size not in (1, wanted):
            raise ValueError(f"{name} of shape {array.shape} does not broadcast to [batch, heads, "
                             f"q_seq, kv_seq] = {target} (axis {axis}: {size} vs {wanted})")
    return array


def int32_array(value, name, *, shape=None, shape_text=None, ndim=None):
    """value as an int32 array: of exactly `shape` (shape_text names its axes: [batch]
    lengths, [batch, seq] segment ids) and/or of rank `ndim`."""
    # The caller's dtype, read before jnp.asarray would quietly narrow int64 to int32.
    given_dtype = getattr(value, "dtype", None)
    array = _as_array(value, name)
    if (given_dtype if given_dtype is not None else array.dtype) != jnp.int32:
        raise DtypeError(f"{name} must be int32, got {given_dtype or array.dtype}")
    if shape is not None and array.shape != shape:
        raise ValueError(f"{name} must have shape {shape_text} = {shape}, got {array.shape}")
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {array.shape}")
    return array


def _seq_lengths(lengths, batch, name):
    return (None if lengths is None else
            int32_array(lengths, name, shape=(batch,), shape_text="[batch]"))


def _segment_ids(query_segment_ids, kv_segment_ids, batch, q_seq_len, kv_seq_len):
    """(query ids int32 [B, T], key ids int32 [B, S] or None when they are the queries')."""
    if query_segment_ids is None and kv_segment_ids is None:
        return None, None
    if query_segment_ids is None:
        raise ValueError("kv_segment_ids needs query_segment_ids")
    if kv_segment_ids is None and q_seq_len != kv_seq_len:
        raise ValueError("kv_segment_ids is required when the query and key/value sequence "
                         f"lengths differ ({q_seq_len} vs {kv_seq_len})")
    q_ids = int32_array(query_segment_ids, "query_segment_ids", shape=(batch, q_seq_len),
                        shape_text="[batch, seq]")
    if kv_segment_ids is None or kv_segment_ids is query_segment_ids:
        return q_ids, None
    kv_ids = int32_array(kv_segment_ids, "kv_segment_ids", shape=(batch, kv_seq_len),
                         shape_text="[batch, seq]")
    return q_ids, kv_ids


def _dropout_rng(rate, dropout_rng):
    """The PRNG key that draws the dropout mask (a rate > 0 needs one), or None."""
    if rate == 0.0:
        return None
    if dropout_rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng, a JAX PRNG key "
                         "(jax.random.key(seed) or jax.random.PRNGKey(seed))")
    rng = jnp.asarray(dropout_rng) if not isinstance(dropout_rng, jax.Array) else dropout_rng
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    if not ((typed and rng.shape == ()) or (not typed and rng.dtype == jnp.uint32 and
                                             rng.shape == (2,))):
        raise TypeError("dropout_rng must be one PRNG key (jax.random.key(seed), shape (), or "
                        f"jax.random.PRNGKey(seed), uint32 (2,)), got {rng.dtype} {rng.shape}")
    return rng

def checked_residual_dtype(value, query):
    """The residual's dtype: the query's (as jax.nn) for None, else a floating dtype."""
    if value is None:
        return jnp.result_type(query)
    try:
        dtype = jnp.dtype(value)
    except TypeError as error:
        raise TypeError(f"residual_dtype must be None or a float dtype, got {value!r}") from error
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"residual_dtype must be None or a float dtype, got {dtype}")
    return dtype


def checked_sinks(value, q_heads, dtype):
    """value as a float32 [N] array (one logit per query head), or None. Float32 or the
    inputs' dtype only: a wider dtype would be narrowed silently."""
    if value is None:
        return None
    given_dtype = getattr(value, "dtype", None)  # before jnp.asarray narrows float64
    array = _as_array(value, "sinks")
    given_dtype = jnp.dtype(array.dtype if given_dtype is None else given_dtype)
    if given_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(dtype)):
        raise TypeError(f"sinks must be float32 or the inputs' dtype ({jnp.dtype(dtype)}), got "
                        f"{given_dtype}")
    if array.shape != (q_heads,):
        raise ValueError(f"sinks must have shape [num_query_heads] = ({q_heads},), got "
                         f"{array.shape}")
    return array


def _takes_five_arguments(fn):
    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(*range(5))
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): let the call tell
        pass
    return True


def _described(fn):
    if not callable(fn):
        return type(fn).__name__
    try:
        return f"{getattr(fn, '__name__', type(fn).__name__)}{inspect.signature(fn)}"
    except ValueError:
        return repr(fn)


def checked_score_mod(score_mod, alibi_slopes, batch, q_heads, q_seq_len, kv_seq_len):
    """One score modifier of the call (reference/attention.py's convention), ALiBi's after the
    user's, or None."""
    if score_mod is not None and not _takes_five_arguments(score_mod):
        raise TypeError(f"score_mod must be a function score_mod(score, batch, head, q_index, "
                        f"kv_index) -> score, got {_described(score_mod)}")
    if alibi_slopes is None:
        return score_mod
    slopes = _as_array(alibi_slopes, "alibi_slopes")
    if slopes.dtype != jnp.float32:
        raise DtypeError(f"alibi_slopes must be float32, got {slopes.dtype}")
    if slopes.shape not in ((q_heads,), (batch, q_heads)):
        raise ValueError(f"alibi_slopes must have shape [num_query_heads] = ({q_heads},) or "
                         f"[batch, num_query_heads] = ({batch}, {q_heads}), got {slopes.shape}")
    with_alibi = alibi(slopes, q_seq_len, kv_seq_len)
    if score_mod is None:
        return with_alibi

    def both(score, *indices):
        return with_alibi(score_mod(score, *indices), *indices)
    return both


def _fp8_options_reason(options, arrays, q_seq_len, kv_seq_len):
    """Why FP8 attention cannot take this call's options (jax_sdpa/limits/fp8.py), or None."""
    given = dict(options, **arrays)
    if not (given.get("is_causal") and q_seq_len != kv_seq_len):
        given["causal_alignment"] = None  # no band to align
    return fp8_limits.options_reason(given)


def validate(query, key, value, bias=None, mask=None, *, query_seq_lengths=None,
             key_value_seq_lengths=None, dropout_rng=None, query_segment_ids=None,
             kv_segment_ids=None, sinks=None, score_mod=None, alibi_slopes=None,
             implementation=None, **options) -> AttentionCall:
    """A dot_product_attention call checked: its arrays here, its scalar options (the rest of
    the keywords) by the description (spec.describe)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    query = _as_array(query, "query")
    key = _as_array(key, "key")
    value = _as_array(value, "value")
    for array, name in ((query, "query"), (key, "key"), (value, "value")):
        _check_float(array, name)
    if not query.dtype == key.dtype == value.dtype:
        raise DtypeError(f"query, key and value must share one dtype, got {query.dtype}, "
                         f"{key.dtype} and {value.dtype}")
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(f"query, key and value must have the same rank, got shapes "
                         f"{query.shape}, {key.shape} and {value.shape}")
    if query.shape[:-3] != key.shape[:-3]:
        raise ValueError(f"query and key must have the same batch axes, got shapes {query.shape} "
                         f"and {key.shape}")
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"key and value must have the same shape but for head_dim, got "
                         f"{key.shape} and {value.shape}")
    output_shape = (*query.shape[:-1], value.shape[-1])
    query, key, value = (_fold_batch(x, n) for x, n in
                         ((query, "query"), (key, "key"), (value, "value")))
    batch, q_seq_len, q_heads, head_dim = query.shape
    _, kv_seq_len, kv_heads, _ = key.shape
    if key.shape[-1] != head_dim:
        raise ValueError(f"query and key must have the same head_dim, got {head_dim} and "
                         f"{key.shape[-1]}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"the number of query heads ({q_heads}) must be a multiple of the number "
                         f"of key/value heads ({kv_heads})")
    target = (batch, q_heads, q_seq_len, kv_seq_len)
    if bias is not None:
        bias = _as_array(bias, "bias")
        _check_float(bias, "bias")
        bias = _broadcastable_4d(bias, target, "bias")
    if mask is not None:
        mask = _as_array(mask, "mask")
        if mask.dtype != jnp.bool_:
            raise DtypeError(f"mask must be boolean (True = attend), got {mask.dtype}")
        mask = _broadcastable_4d(mask, target, "mask")
    q_ids, kv_ids = _segment_ids(query_segment_ids, kv_segment_ids, batch, q_seq_len,
                                 kv_seq_len)
    q_lengths = _seq_lengths(query_seq_lengths, batch, "query_seq_lengths")
    # One array given for both stays one (AttentionCall.same_lengths).
    kv_lengths = (q_lengths if key_value_seq_lengths is query_seq_lengths else
                  _seq_lengths(key_value_seq_lengths, batch, "key_value_seq_lengths"))
    described = Operands(
        head_dim=head_dim, q_seq_len=q_seq_len, kv_seq_len=kv_seq_len,
        bias_shape=None if bias is None else bias.shape,
        has_lengths=q_lengths is not None or kv_lengths is not None,
        same_lengths=q_lengths is not None and kv_lengths is q_lengths,
        segments="" if q_ids is None else ("self" if kv_ids is None else "cross"),
        has_sinks=sinks is not None,
        has_score_mod=score_mod is not None or alibi_slopes is not None)
    spec = describe(described, **options)
    if spec.fp8:
        reason = _fp8_options_reason(options, dict(
            bias=bias, mask=mask, query_segment_ids=q_ids, sinks=sinks, score_mod=score_mod,
            alibi_slopes=alibi_slopes), q_seq_len, kv_seq_len)
        if reason:
            raise ValueError(reason)
    return AttentionCall(
        spec=spec, query=query, key=key, value=value, bias=bias, mask=mask,
        query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
        output_shape=output_shape, dropout_rng=_dropout_rng(spec.dropout, dropout_rng),
        query_segment_ids=q_ids, kv_segment_ids=kv_ids,
        sinks=checked_sinks(sinks, q_heads, query.dtype),
        score_mod=checked_score_mod(score_mod, alibi_slopes, batch, q_heads, q_seq_len,
                                    kv_seq_len))

"""CallSpec: the description of one attention call, everything static about it, in one frozen
(hashable) value: the semantics (band, scale, dropout, soft-cap, which optional operands are
there, packing, FP8) and, once planned, how it runs (implementation, determinism); and
describe(), which checks the call's scalar options and makes one.

The entry points make it (dot_product_attention through describe; paged, ring and
jax_sdpa.fp8 directly); jax_sdpa/call/planning.py refines the same value for cuDNN
(dataclasses.replace: an equivalent band, the operands' layout, the implementation). It
travels unchanged through the custom_vjp, the sharding rules and the kernels
(jax_sdpa/kernels/) down to the FFI call (jax_sdpa/cudnn/call.py), where its graph options
become the attributes of the targets their metadata names, and SdpaConfig's fields in C++ (both
generated from this file's fields: cmake/generate_targets.py); the reference path reads it
too (reference/attention.py's spec_options). A new scalar option of the graph is a keyword
(api/attention.py), a field and its check here, its setter in the graph builder
(ffi/graph/graph_description.cc) and its meaning in the reference. The build loads this file
by path: standard library only.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

# Every array a kernel call can take, in the order the FFI and the sharding rules list them.
INPUTS = ("query", "key", "value", "bias", "q_lengths", "kv_lengths", "q_segment_ids",
          "kv_segment_ids", "dropout_seed", "sinks", "page_table", "score_mod_tables")
IMPLEMENTATIONS = ("cudnn", "xla")  # cuDNN's fused kernels, or the pure-JAX reference
_UNBOUNDED = 1 << 30  # a window bound no sequence reaches



# The FFI targets of each job by handler (jax_sdpa/cudnn/targets.py), for the graph options.
_DENSE = ("DenseForward", "DenseBackward")
_RAGGED = ("RaggedForward", "RaggedBackward")
_PAGED = ("PagedForward",)
_FP8 = ("Fp8Forward", "Fp8Backward")
_BACKWARDS = ("DenseBackward", "RaggedBackward")


def graph_option(targets, **field_options):
    """A field that cuDNN's graph takes: an FFI attribute of these targets (by handler) under
    the field's name, and a field of SdpaConfig's (ffi/graph/sdpa_config.h, generated from this
    metadata by cmake/generate_targets.py): a new scalar option of the graph is declared here
    alone."""
    return dataclasses.field(metadata={"graph_option": targets}, **field_options)


# An FP8 call's backward on cuDNN's float16/bfloat16 graphs (limits/fp8.half_backward_reason).
HALF_BACKWARD = "cudnn_half"


class Piece(NamedTuple):
    """One rectangle of a mask cut into pieces (jax_sdpa/pieces/): query rows [q_start,
    q_stop) against keys [kv_start, kv_stop) of query heads [head_start, head_stop) (every head
    when head_stop is 0), run by the dense kernels with its own band (CallSpec's fields,
    measured within the rectangle)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    window_left: int = -1
    window_right: int = -1
    bottom_right: bool = False
    head_start: int = 0
    head_stop: int = 0


@dataclasses.dataclass(frozen=True)
class CallSpec:
    scale: float = graph_option(_DENSE + _RAGGED + _PAGED + _FP8)
    # The causal/window band: query i sees keys j with i - window_left <= j <= i + window_right
    # (local_window_size's inclusive bounds), measured from the top-left diagonal, or from the
    # bottom-right one with bottom_right (set only where T != S); -1: no bound. Causal is
    # window_right = 0. Planning may move a bottom-right band onto the top-left diagonal (the
    # same band for these T and S). (cuDNN's left bound is exclusive: the graph builder alone
    # translates, ffi/sdpa_graphs.cc.)
    window_left: int = graph_option(_DENSE + _RAGGED + _PAGED, default=-1)
    window_right: int = graph_option(_DENSE + _RAGGED + _PAGED + _FP8, default=-1)
    bottom_right: bool = graph_option(_DENSE + _PAGED, default=False)
    deterministic: bool = graph_option(_BACKWARDS, default=False)
    # The probability of dropping a weight; > 0 needs a dropout_seed input.
    dropout: float = graph_option(_DENSE + _RAGGED, default=0.0)
    # "xla" (the reference: a call as validated) or "cudnn", as planned.
    implementation: str = "cudnn"
    # The backward's kernel, when it differs from the forward's: "xla" (a cuDNN forward whose
    # backward cuDNN cannot run, e.g. T = S = 1) or HALF_BACKWARD (an FP8 forward's backward on
    # cuDNN's half-precision graphs, from the FP8 forward's output and stats).
    backward_implementation: str | None = None
    # Optional inputs: a bias [1|B, 1|N, T, S] (the user's; planned for cuDNN, also a mask's
    # and dense segment ids', with a gradient for the user's alone), valid lengths [B].
    has_bias: bool = False
    bias_batch_full: bool = False
    bias_heads_full: bool = False
    bias_grad: bool = False
    has_lengths: bool = False
    # The key/value lengths are the query lengths (one array given for both).
    same_lengths: bool = False
    # Packed documents from segment ids [B, T] / [B, S]: "" none, "self" (keys share the
    # queries' ids), "cross" (kv_segment_ids of their own); at most max_segments documents per
    # row run on cuDNN's ragged layout, anything else on the exact fallback (packing/): a
    # dense call with the ids as operands (the segment_mask attribute). Planning clears it
    # where the ids must become a dense bias instead.
    segments: str = ""
    max_segments: int = 0
    # (queries, keys): the caller's stated bound on a document's tokens (its documents are
    # contiguous runs, at most max_segments per row): one ragged plan, no check on the device,
    # rows breaking it poisoned with NaN; () when not stated (packing/ragged.py).
    max_document_length: tuple[int, ...] = ()
    # Scaled scores become cap * tanh(scores / cap) before the bias and masks; 0: none.
    logits_soft_cap: float = graph_option(_DENSE, default=0.0)
    # A sinks input (float [N], one logit per query head): the kernels scale their output by
    # the sink's share of each row (jax_sdpa/kernels/sink_softmax.py); cuDNN itself never sees it.
    has_sinks: bool = False
    # A score modifier (score_mod, alibi_slopes); on cuDNN, written as pointwise programs
    # (jax_sdpa/score_mod/program.py): the forward's, its derivative's, and how many tables
    # (the score_mod_tables input, float32 [B, tables, N]) they read.
    has_score_mod: bool = False
    score_mod: str = graph_option(_DENSE, default="")
    score_mod_bprop: str = graph_option(("DenseBackward",), default="")
    score_mod_tables: int = graph_option(_DENSE, default=0)
    # FP8 attention (jax_sdpa/reference/fp8_scaling.py's recipe): "" none, else the backward's
    # format ("e5m2" or "e4m3") for dO, dS and the gradients; Q, K, V, P and O are e4m3.
    fp8: str = ""
    # Keys and values are page pools [P, page_size, K, H|Hv] read through a page_table input
    # (int32 [B, max_pages]), forward only (paged_attention); with lengths, a bottom-right band
    # is measured from each row's own lengths (query i at key kv_lengths - q_lengths + i), as
    # cuDNN's padding mask measures it.
    paged: bool = False
    # Our FFI targets XLA may record into CUDA graphs (jax_sdpa/cudnn/command_buffers.py,
    # JAX_SDPA_COMMAND_BUFFERS).
    command_buffer: bool = False
    # A mask cut into pieces (jax_sdpa/pieces/): the forward's and the backward's, each a
    # partition of the kept scores into Pieces the dense kernels run at their own cost, merged
    # by log-sum-exp; () without. The rest of the spec applies to every piece.
    pieces: tuple = ()
    backward_pieces: tuple = ()

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                             f"{self.implementation!r}")
        if self.fp8 not in ("", "e5m2", "e4m3"):
            raise ValueError(f"fp8 must be '', 'e5m2' or 'e4m3', got {self.fp8!r}")
        if self.segments not in ("", "self", "cross"):
            raise ValueError(f"segments must be '', 'self' or 'cross', got {self.segments!r}")

    @property
    def half_backward(self) -> bool:
        return self.backward_implementation == HALF_BACKWARD

    @property
    def backward_kernel(self) -> str:
        return self.backward_implementation or self.implementation

    @property
    def has_seed(self) -> bool:
        return self.dropout > 0.0

    @property
    def banded(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    def window(self) -> tuple[int, int] | None:
        """The band as the reference's local_window_size ((left, right), inclusive, a bound
        no sequence reaches for an open side), or None without one."""
        if not self.banded:
            return None
        unbounded = lambda bound: bound if bound >= 0 else _UNBOUNDED  # noqa: E731
        return unbounded(self.window_left), unbounded(self.window_right)

    def diagonal_offset(self, q_seq_len: int, kv_seq_len: int) -> int:
        """Where query i sits among the keys: key i + offset (0 top-left, S - T bottom-right)."""
        return kv_seq_len - q_seq_len if self.bottom_right else 0

    def input_names(self) -> tuple[str, ...]:
        """The inputs a call with this config takes, in INPUTS order."""
        present = {"query": True, "key": True, "value": True, "bias": self.has_bias,
                   "q_lengths": self.has_lengths, "kv_lengths": self.has_lengths,
                   "q_segment_ids": bool(self.segments),
                   "kv_segment_ids": self.segments == "cross", "dropout_seed": self.has_seed,
                   "sinks": self.has_sinks, "page_table": self.paged,
                   "score_mod_tables": self.score_mod_tables > 0}
        return tuple(name for name in INPUTS if present[name])

    def zero_fill(self, *, ragged: bool = False) -> str:
        """What the handler makes of the elements cuDNN leaves unwritten (tokens past a length,
        or of no document) so that they are zeros: "tails", the tokens past each row's
        lengths, after cuDNN ran (the int32 [B, 2] tails operand); "all", every output before
        cuDNN runs; "" nothing, where cuDNN writes every element. Tails suffice where cuDNN
        writes every token within the lengths: a dense call whose rows there all see a key
        (no left window bound or bottom-right band to empty one), or documents of one packed
        row that cover it up to its lengths (self-attention, one lengths array for both)."""
        if not (self.has_lengths or (ragged and self.segments == "cross")):
            return ""
        if self.paged:
            return "all"
        if ragged:
            return "tails" if self.segments == "self" and self.same_lengths else "all"
        return "tails" if self.window_left < 0 and not self.bottom_right else "all"


def graph_options(handler: str) -> dict:
    """{name: kind} ("float", "int", "bool" or "str", the field's type) of the graph options the FFI
    target of this handler takes, in field order."""
    return {field.name: str(field.type) for field in dataclasses.fields(CallSpec)
            if handler in field.metadata.get("graph_option", ())}


# --- the scalar options of dot_product_attention, checked into a CallSpec ----------------------

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
DEFAULT_MAX_SEGMENTS = 64


class Operands(NamedTuple):
    """What describe needs to know of a call's arrays (validated and folded to rank 4)."""

    head_dim: int
    q_seq_len: int
    kv_seq_len: int
    bias_shape: tuple | None  # [1|B, 1|N, T, S]
    has_lengths: bool
    same_lengths: bool  # one lengths array given for both sides
    segments: str  # "", "self", "cross"
    has_sinks: bool
    has_score_mod: bool = False  # score_mod or alibi_slopes


def python_number(value, name, integral=False, none_allowed=True):
    """value as a Python int (integral) or float, else a TypeError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integral else
                                                 numbers.Real):
        kind = "int" if integral else "float"
        raise TypeError(f"{name} must be a Python {kind}{' or None' if none_allowed else ''}, "
                        f"got {type(value).__name__}")
    return int(value) if integral else float(value)


def checked_scale(scale, head_dim):
    """The score scale: 1 / sqrt(head_dim) by default, else a finite Python float."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = python_number(scale, "scale")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def checked_window(local_window_size):
    """(left, right) as non-negative ints, or None."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, numbers.Integral) and not isinstance(local_window_size, bool):
        window = (int(local_window_size), int(local_window_size))
    elif (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2 and
          all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
              for w in local_window_size)):
        window = (int(local_window_size[0]), int(local_window_size[1]))
    else:
        raise TypeError("local_window_size must be an int or a (left, right) pair of ints, got "
                        f"{local_window_size!r}")
    if min(window) < 0:
        raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
    return window


def checked_soft_cap(cap):
    """cap as a positive finite float, or None."""
    if cap is None:
        return None
    cap = python_number(cap, "logits_soft_cap")
    if not (math.isfinite(cap) and cap > 0.0):
        raise ValueError(f"logits_soft_cap must be a positive finite number, got {cap}")
    return cap


def checked_dropout_rate(dropout_rate):
    rate = python_number(dropout_rate, "dropout_rate", none_allowed=False)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    return rate


def _max_segments(max_segments):
    if max_segments is None:
        return DEFAULT_MAX_SEGMENTS
    max_segments = python_number(max_segments, "max_segments", integral=True)
    if max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments}")
    return max_segments


def _max_document_length(value, operands: Operands):
    """(queries, keys) as ints >= 1, clipped to the rows' lengths, or ()."""
    if value is None:
        return ()
    if not operands.segments:
        raise ValueError("max_document_length states a bound on packed documents: it needs "
                         "query_segment_ids")
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2:
        raise ValueError(f"max_document_length must be an int or (queries, keys), got {value!r}")
    pair = tuple(python_number(n, "max_document_length", integral=True) for n in pair)
    if min(pair) < 1:
        raise ValueError(f"max_document_length must be >= 1, got {value!r}")
    return min(pair[0], operands.q_seq_len), min(pair[1], operands.kv_seq_len)


def _fp8_format(fp8):
    """The FP8 backward's format ("" without fp8)."""
    if not isinstance(fp8, bool) and type(fp8).__name__ != "bool_":
        raise TypeError(f"fp8 must be a Python bool, got {type(fp8).__name__}")
    return "e5m2" if fp8 else ""


def describe(operands: Operands, *, scale=None, is_causal=False, local_window_size=None,
             causal_alignment="top_left", dropout_rate=0.0, max_segments=None,
             logits_soft_cap=None, max_document_length=None, fp8=False) -> CallSpec:
    """The CallSpec of a dot_product_attention call: its scalar keyword arguments checked
    (TypeError / ValueError naming the argument), the reference's description of it
    (implementation "xla" until planned)."""
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, got "
                         f"{causal_alignment!r}")
    if not isinstance(is_causal, bool) and type(is_causal).__name__ != "bool_":
        raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")
    window = checked_window(local_window_size)
    left, right = window or (-1, -1)
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    banded = left >= 0 or right >= 0
    bias = operands.bias_shape
    segments_per_row = _max_segments(max_segments)
    return CallSpec(
        scale=checked_scale(scale, operands.head_dim), window_left=left, window_right=right,
        bottom_right=(banded and causal_alignment == "bottom_right" and
                      operands.q_seq_len != operands.kv_seq_len),
        dropout=checked_dropout_rate(dropout_rate), implementation="xla",
        has_bias=bias is not None, bias_batch_full=bias is not None and bias[0] > 1,
        bias_heads_full=bias is not None and bias[1] > 1, bias_grad=bias is not None,
        has_lengths=operands.has_lengths, same_lengths=operands.same_lengths,
        segments=operands.segments,
        max_segments=segments_per_row if operands.segments else 0,
        max_document_length=_max_document_length(max_document_length, operands),
        logits_soft_cap=checked_soft_cap(logits_soft_cap) or 0.0, has_sinks=operands.has_sinks,
        has_score_mod=operands.has_score_mod, fp8=_fp8_format(fp8))

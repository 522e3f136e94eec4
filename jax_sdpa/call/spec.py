"""CallSpec: the description of one attention call, everything static about it, in one frozen
(hashable) value: the semantics (band, scale, dropout, soft-cap, which optional operands are
there, packing, FP8) and, once planned, how it runs (implementation, determinism).

jax_sdpa/validation.py makes it from the keyword arguments (the other entry points, paged,
ring and jax_sdpa.fp8, make theirs directly); jax_sdpa/planning.py refines the same value for
cuDNN (dataclasses.replace: an equivalent band, the operands' layout, the implementation). It
travels unchanged through the custom_vjp (kernel_vjp.py), the sharding rules
(sharding_rules.py) and the kernels (kernels.py) down to the FFI call, where it produces the
attributes that ffi/attribute_list.h lists and SdpaConfig mirrors (tests/test_lowering.py
checks them against the extension's own list); the reference path reads it too. Adding a
scalar option means a field here and its entry in _OWN_ATTRIBUTES, its line in
ffi/attribute_list.h, its use in the graph builder and in the reference, and its keyword.
"""

from __future__ import annotations

import dataclasses

# Every array a kernel call can take, in the order the FFI and the sharding rules list them.
INPUTS = ("query", "key", "value", "bias", "q_lengths", "kv_lengths", "q_segment_ids",
          "kv_segment_ids", "dropout_seed", "sinks", "page_table")
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
    # The backward's kernel, when it differs from the forward's (a cuDNN forward whose backward
    # cuDNN cannot run, e.g. T = S = 1).
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
    # row run on cuDNN's ragged layout, anything else on the exact fallback (kernels.py): a
    # dense call with the ids as operands (the segment_mask attribute). Planning clears it
    # where the ids must become a dense bias instead.
    segments: str = ""
    max_segments: int = 0
    # (queries, keys): the caller's stated bound on a document's tokens (its documents are
    # contiguous runs, at most max_segments per row): one ragged plan, no check on the device,
    # rows breaking it poisoned with NaN; () when not stated (kernels.py).
    max_document_length: tuple[int, ...] = ()
    # Scaled scores become cap * tanh(scores / cap) before the bias and masks; 0: none.
    logits_soft_cap: float = graph_option(_DENSE, default=0.0)
    # A sinks input (float [N], one logit per query head): the kernels scale their output by
    # the sink's share of each row (jax_sdpa/sink_softmax.py); cuDNN itself never sees it.
    has_sinks: bool = False
    # FP8 attention (jax_sdpa/fp8_scaling.py's recipe): "" none, else the backward's format
    # ("e5m2" or "e4m3") for dO, dS and the gradients; Q, K, V, P and O are e4m3.
    fp8: str = ""
    # Keys and values are page pools [P, page_size, K, H|Hv] read through a page_table input
    # (int32 [B, max_pages]), forward only (paged_attention); with lengths, a bottom-right band
    # is measured from each row's own lengths (query i at key kv_lengths - q_lengths + i), as
    # cuDNN's padding mask measures it.
    paged: bool = False
    # Our FFI targets XLA may record into CUDA graphs (jax_sdpa/command_buffers.py,
    # JAX_SDPA_COMMAND_BUFFERS).
    command_buffer: bool = False

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                             f"{self.implementation!r}")
        if self.fp8 not in ("", "e5m2", "e4m3"):
            raise ValueError(f"fp8 must be '', 'e5m2' or 'e4m3', got {self.fp8!r}")
        if self.segments not in ("", "self", "cross"):
            raise ValueError(f"segments must be '', 'self' or 'cross', got {self.segments!r}")

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
                   "sinks": self.has_sinks, "page_table": self.paged}
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
    """{name: kind} ("float", "int" or "bool", the field's type) of the graph options the FFI
    target of this handler takes, in field order."""
    return {field.name: str(field.type) for field in dataclasses.fields(CallSpec)
            if handler in field.metadata.get("graph_option", ())}

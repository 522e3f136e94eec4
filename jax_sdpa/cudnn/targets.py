"""Our XLA FFI targets, declared once: one per job and direction, each with exactly the operands,
results and attributes its handler binds.

The C++ handlers' operand readers and attribute structs are generated from this table at build
time (cmake/generate_targets.py writes targets.inc), and jax_sdpa/cudnn/call.py orders every
call's operands and attributes by it, so the two sides cannot disagree. A target also takes the
graph options of CallSpec (jax_sdpa/call/spec.py: the fields whose metadata names the target),
before its own attributes. The build loads this file by path: standard library only.
"""

from __future__ import annotations

from typing import NamedTuple


class Target(NamedTuple):
    """One FFI target. Operands come in order: the fixed ones, then each optional group whose
    presence attribute is nonzero; results likewise. Attributes are (name, kind), kind "bool",
    "int" (int64) or "float" (float32)."""

    name: str
    handler: str  # the C++ handler's name (and the prefix of its generated declarations)
    operands: tuple
    optional: tuple = ()  # ((operand, ...), presence attribute)
    results: tuple = ()
    optional_results: tuple = ()
    attributes: tuple = ()

    @property
    def command_buffer_name(self) -> str:
        """The same handler, which XLA may record into its command buffers (CUDA graphs)."""
        return self.name + "_cmdbuf"


# Every target has these: whether XLA may record it (command_buffer: see PrepareCall in
# ffi/run/execution.cc) and whether its last result is its cuDNN workspace, sized while
# tracing (jax_sdpa/cudnn/call.py).
_RECORDING = (("command_buffer", "bool"), ("workspace_result", "bool"))
_WORKSPACE = (("workspace",), "workspace_result")
# Zeros where cuDNN leaves elements unwritten: every output before it runs (zero_outputs), or
# the tokens past each row's lengths after (zero_tails, with an int32 [B, 2] tails operand).
_ZERO_FILLS = (("zero_outputs", "bool"), ("zero_tails", "bool"))
_BACKWARD_INPUTS = ("output", "stats", "d_output")
_GRADIENTS = ("dq", "dk", "dv")

# Dense [B, T, N, H] rows: a bias, lengths, segment ids masked inside cuDNN's kernel, dropout,
# a score modifier's tables (present when the graph option score_mod_tables counts some).
_DENSE_OPTIONAL = ((("bias",), "has_bias"), (("q_lengths", "kv_lengths"), "padding"),
                   (("q_segment_ids", "kv_segment_ids"), "segment_mask"),
                   (("dropout_seed",), "dropout"), (("tails",), "zero_tails"),
                   (("score_mod_tables",), "score_mod_tables"))
_DENSE_ATTRIBUTES = (("has_bias", "bool"), ("padding", "bool"), ("segment_mask", "bool"),
                     *_ZERO_FILLS, *_RECORDING)

# Packed documents on cuDNN's ragged layout: lengths per document and element offsets; a grid
# the device chose, with the ids the dense fallback masks when the grid holds no document;
# rows breaking a stated bound poisoned (jax_sdpa/packing/ragged.py).
_RAGGED_OPERANDS = ("query", "key", "value", "q_lengths", "kv_lengths", "offsets")
_RAGGED_OPTIONAL = ((("grid",), "device_grid"), (("q_segment_ids", "kv_segment_ids"),
                                                 "fallback_ids"),
                    (("dropout_seed",), "dropout"), (("poison_rows",), "poison_rows"),
                    (("tails",), "zero_tails"))
_RAGGED_ATTRIBUTES = (("max_document_length_q", "int"), ("max_document_length_kv", "int"),
                      ("device_grid", "bool"), ("fallback_ids", "bool"), ("poison_rows", "bool"),
                      *_ZERO_FILLS, *_RECORDING)

# FP8: e4m3 inputs with float32 scale rows, amaxes out (jax_sdpa/kernels/fp8.py).
_FP8_OPTIONAL = ((("q_lengths", "kv_lengths"), "padding"), (("tails",), "zero_tails"))
_FP8_ATTRIBUTES = (("padding", "bool"), ("zero_tails", "bool"), *_RECORDING)

TARGETS = (
    Target("jax_sdpa_dense_forward", "DenseForward", ("query", "key", "value"),
           _DENSE_OPTIONAL, ("output", "stats"), (_WORKSPACE,), _DENSE_ATTRIBUTES),
    Target("jax_sdpa_dense_backward", "DenseBackward",
           ("query", "key", "value", *_BACKWARD_INPUTS), _DENSE_OPTIONAL, _GRADIENTS,
           ((("dbias",), "bias_grad"), _WORKSPACE), (*_DENSE_ATTRIBUTES, ("bias_grad", "bool"))),
    Target("jax_sdpa_ragged_forward", "RaggedForward", _RAGGED_OPERANDS, _RAGGED_OPTIONAL,
           ("output", "stats"), (_WORKSPACE,), _RAGGED_ATTRIBUTES),
    Target("jax_sdpa_ragged_backward", "RaggedBackward", (*_RAGGED_OPERANDS, *_BACKWARD_INPUTS),
           _RAGGED_OPTIONAL, _GRADIENTS, (_WORKSPACE,), _RAGGED_ATTRIBUTES),
    Target("jax_sdpa_paged_forward", "PagedForward",
           ("query", "key", "value", "q_lengths", "kv_lengths", "page_table"), (),
           ("output", "stats"), (_WORKSPACE,), _RECORDING),
    Target("jax_sdpa_fp8_forward", "Fp8Forward", ("query", "key", "value", "scales"),
           _FP8_OPTIONAL, ("output", "stats", "amaxes"), (_WORKSPACE,), _FP8_ATTRIBUTES),
    Target("jax_sdpa_fp8_backward", "Fp8Backward",
           ("query", "key", "value", *_BACKWARD_INPUTS, "scales"), _FP8_OPTIONAL,
           (*_GRADIENTS, "amaxes"), (_WORKSPACE,),
           (("gradient_type", "int"), *_FP8_ATTRIBUTES)),
)

BY_NAME = {target.name: target for target in TARGETS}

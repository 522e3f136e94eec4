// XLA FFI handlers for cuDNN SDPA on CUDA:
//   forward:  (q, k, v, [bias], [q_lengths, kv_lengths], [offsets], [seed], [poison_rows],
//             [tails]) -> (o, stats)
//   backward: (q, k, v, o, stats, d_o, [bias], [q_lengths, kv_lengths], [offsets], [seed],
//             [poison_rows], [tails]) -> (dq, dk, dv, [dbias])
// Per example, q/dq are [batch, q_seq, q_heads, head_dim], k/dk [batch, kv_seq, kv_heads,
// head_dim], v/dv [batch, kv_seq, kv_heads, head_dim_v], o/d_o [batch, q_seq, q_heads,
// head_dim_v], stats float32 [batch, q_heads, q_seq] (log-sum-exp of each scaled score row),
// bias [1|batch, 1|q_heads, q_seq, kv_seq] in the inputs' dtype, lengths int32 [batch], seed
// uint32 [4] (Philox seed and offset), poison_rows int32 [batch]: rows whose first token of o
// (dq, dk, dv) the handler sets to NaN after cuDNN ran, tails int32 [batch, 2]: each row's
// query and key tokens past which o, dq (dk, dv) become zeros after cuDNN ran (row_fills.h).
// Ragged (packed documents): lengths are int32 [documents] (each document's query and key/value
// tokens), offsets int32 [5, R] (R >= documents + 1) the element offsets of each document in q,
// k, v, o and stats, and stats are token-major: float32 [batch, q_seq, q_heads].
// vmap adds the same leading axes to every operand (vmap_method="broadcast_all"); they fold into
// the batch, or, for a bias shared across the batch, a seed or documents per slice, become
// repeated executions of one graph.
// With the workspace_result attribute, the last result is a uint8 buffer XLA allocated for the
// call's cuDNN workspace, sized by PlannedWorkspaceBytes (workspace_planning.h) when Python
// planned the call.
// The *CommandBuffer handlers are the same, marked so that XLA may record them into its command
// buffers (CUDA graphs).
// Each target pairs an execute handler with CallStateInstantiateHandler, which creates the
// per-call state (call_state.h) when XLA loads an executable.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {

XLA_FFI_DECLARE_HANDLER_SYMBOL(CallStateInstantiateHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SdpaForwardHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SdpaBackwardHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SdpaForwardCommandBufferHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SdpaBackwardCommandBufferHandler);

}  // namespace jax_sdpa

// XLA FFI handlers for cuDNN SDPA on CUDA:
//   forward:  (q, k, v, [bias], [q_lengths, kv_lengths], [seed]) -> (o, stats, [dropout_mask])
//   backward: (q, k, v, o, stats, d_o, [bias], [q_lengths, kv_lengths], [seed])
//             -> (dq, dk, dv, [dbias])
// Per example, q/dq are [batch, q_seq, q_heads, head_dim], k/dk [batch, kv_seq, kv_heads,
// head_dim], v/dv [batch, kv_seq, kv_heads, head_dim_v], o/d_o [batch, q_seq, q_heads,
// head_dim_v], stats float32 [batch, q_heads, q_seq] (log-sum-exp of each scaled score row),
// bias [1|batch, 1|q_heads, q_seq, kv_seq] in the inputs' dtype, lengths int32 [batch], seed
// uint32 [4] (Philox seed and offset). vmap adds the same leading axes to every operand
// (vmap_method="broadcast_all"); they fold into the batch, or, for a bias shared across the
// batch or a seed per slice, become repeated executions of one graph.
// The *CommandBuffer handlers are the same, marked so that XLA may record them into its command
// buffers (CUDA graphs); each call then owns its workspace instead of per-call scratch.
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

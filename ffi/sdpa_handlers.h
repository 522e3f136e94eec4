// XLA FFI handlers for cuDNN SDPA on CUDA:
//   forward:  (q, k, v, [bias], [q_lengths, kv_lengths]) -> (o, stats)
//   backward: (q, k, v, o, stats, d_o, [bias], [q_lengths, kv_lengths]) -> (dq, dk, dv, [dbias])
// Per example, q/o/dq are [batch, q_seq, q_heads, head_dim], k/v/dk/dv [batch, kv_seq, kv_heads,
// head_dim], stats float32 [batch, q_heads, q_seq] (log-sum-exp of each scaled score row), bias
// [1|batch, 1|q_heads, q_seq, kv_seq] in the inputs' dtype, lengths int32 [batch]. vmap adds the
// same leading axes to every operand (vmap_method="broadcast_all"); they fold into the batch, or,
// for a bias shared across the batch, become repeated executions of one graph.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {

XLA_FFI_DECLARE_HANDLER_SYMBOL(SdpaForwardHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SdpaBackwardHandler);

}  // namespace jax_sdpa

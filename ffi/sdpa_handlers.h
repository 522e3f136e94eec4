// XLA FFI handlers for cuDNN SDPA on CUDA:
//   forward:  (q, k, v) -> (o, stats)
//   backward: (q, k, v, o, stats, d_o) -> (dq, dk, dv)
// q/o/dq are [batch..., q_seq, q_heads, head_dim], k/v/dk/dv [batch..., kv_seq, kv_heads,
// head_dim] (any number of leading batch axes, e.g. from vmap), stats float32
// [batch..., q_heads, q_seq] (the log-sum-exp of each scaled score row).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {

XLA_FFI_DECLARE_HANDLER_SYMBOL(SdpaForwardHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SdpaBackwardHandler);

}  // namespace jax_sdpa

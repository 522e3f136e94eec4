// NaN in the first token of chosen rows of a result, written on the device after cuDNN ran:
// the mark a packed call leaves on rows that break the caller's stated document bound. Done in
// the handler, so that XLA never updates a slice of our call's result (its dynamic-slice fusion
// cannot take a custom call's result as the buffer it updates).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {

// buffer: [rows..., tokens, heads, dim] (rank >= 3) on `device`, whose context is current;
// flags: int32 [rows] there. Every element of buffer[r, 0] with flags[r] != 0 becomes
// all-ones bytes (NaN in every float type).
xla::ffi::Error PoisonFirstTokens(cudaStream_t stream, int32_t device,
                                  const xla::ffi::AnyBuffer& flags, xla::ffi::AnyBuffer buffer);

}  // namespace jax_sdpa

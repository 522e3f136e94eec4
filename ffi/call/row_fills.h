// Fills of chosen tokens of a result, written on the device after cuDNN ran, by small PTX
// kernels. Done in the handler, so that XLA never updates a slice of our call's result (its
// dynamic-slice fusion cannot take a custom call's result as the buffer it updates), and so
// that only what cuDNN leaves unwritten is written again.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/operand.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {

// buffer: [rows..., tokens, heads, dim] (rank >= 3) on `device`, whose context is current;
// flags: int32 [rows] there. Every element of buffer[r, 0] with flags[r] != 0 becomes
// all-ones bytes (NaN in every float type): the mark a packed call leaves on rows that break
// the caller's stated document bound.
xla::ffi::Error PoisonFirstTokens(cudaStream_t stream, int32_t device,
                                  const Operand& flags, xla::ffi::AnyBuffer buffer);

// buffer as above; tails: int32 [rows, 2] there. Every token t >= tails[r, side] of row r
// becomes zeros: the tokens past a row's lengths, which cuDNN leaves unwritten (side 0: the
// queries', for the output and dq; side 1: the keys', for dk and dv). A row whose tail is its
// length costs one block that returns at once, where zero-filling the whole buffer before
// cuDNN ran cost a pass over it.
xla::ffi::Error ZeroTokenTails(cudaStream_t stream, int32_t device,
                               const Operand& tails, int side,
                               xla::ffi::AnyBuffer buffer);

}  // namespace jax_sdpa

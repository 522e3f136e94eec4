// Tests' proof that every output element is written: our FFI targets wrapped so that each
// result (outputs, and the cuDNN workspace XLA allocates as the last result) is filled with
// all-ones bytes, NaN in every float type, before the product's handler runs on the same call
// frame. The product's handlers, config and graph cache know nothing of it.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jax_sdpa {

// The wrapper of product handler `slot` (0 to kPoisonedSlots - 1), once SetPoisonedTarget has
// named the handler it wraps.
constexpr int kPoisonedSlots = 16;  // every target and its command-buffer twin
XLA_FFI_Handler* PoisonedHandler(int slot);
void SetPoisonedTarget(int slot, XLA_FFI_Handler* product);

}  // namespace jax_sdpa

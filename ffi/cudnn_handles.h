// One cuDNN handle per device, shared by every stream: a caller holds the device's lock while it
// points the handle at its stream and enqueues work, so handles never cross devices or threads.
#pragma once

#include <cudnn.h>

#include <cstdint>
#include <mutex>

#include "check.h"

namespace jax_sdpa {

struct CudnnHandleLease {
  cudnnHandle_t handle = nullptr;
  std::unique_lock<std::mutex> lock;
};

// Creates the device's handle on first use, locks it and binds it to `stream`.
ffi::Error AcquireCudnnHandle(int32_t device, cudaStream_t stream, CudnnHandleLease* lease);

}  // namespace jax_sdpa

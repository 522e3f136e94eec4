// A pool of cuDNN handles per device (as jaxlib's HandlePool): a call borrows one, bound to its
// stream, for as long as it enqueues work, and gives it back after. Calls on different streams
// (or threads) never wait for one another's handle, and a handle never serves two calls at once.
#pragma once

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <cstdint>

#include "common/check.h"

namespace jax_sdpa {

class BorrowedCudnnHandle {
 public:
  // A handle of `device` bound to `stream`: from the pool, or created on first use.
  static ffi::ErrorOr<BorrowedCudnnHandle> Borrow(int32_t device, cudaStream_t stream);

  BorrowedCudnnHandle(BorrowedCudnnHandle&& other) noexcept;
  BorrowedCudnnHandle& operator=(BorrowedCudnnHandle&&) = delete;
  BorrowedCudnnHandle(const BorrowedCudnnHandle&) = delete;
  ~BorrowedCudnnHandle();  // back to the pool

  cudnnHandle_t get() const { return handle_; }

 private:
  BorrowedCudnnHandle(int32_t device, cudnnHandle_t handle, cudaStream_t stream)
      : device_(device), handle_(handle), stream_(stream) {}

  int32_t device_;
  cudnnHandle_t handle_;
  cudaStream_t stream_;  // the stream the handle is bound to
};

}  // namespace jax_sdpa

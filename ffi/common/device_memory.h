// Device memory owned by an object (freed with it), and a scope that makes one device current.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/check.h"

namespace jax_sdpa {

// Sets the current device for one scope and restores the caller's afterwards.
class ScopedDevice {
 public:
  explicit ScopedDevice(int32_t device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      status_ = cudaSetDevice(device);
      restore_ = true;
    }
  }
  ~ScopedDevice() {
    if (restore_) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  bool restore_ = false;
  cudaError_t status_ = cudaSuccess;
};

class DeviceMemory {
 public:
  DeviceMemory() = default;
  ~DeviceMemory() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  // `bytes` (at least one) on the current device.
  ffi::Error Allocate(int64_t bytes) {
    JAX_SDPA_CUDA_CHECK(cudaMalloc(&data_, static_cast<size_t>(bytes > 0 ? bytes : 1)));
    return ffi::Error::Success();
  }
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
};

}  // namespace jax_sdpa

// While XLA records a command buffer it captures the stream our handler runs on; building a
// cuDNN graph or allocating memory is then illegal in CUDA's default (thread-local) capture
// mode. Neither is a stream operation, so relaxing this thread's mode for their duration is
// the documented way to allow them; the caller's mode comes back at the end of the scope.
#pragma once

#include <cuda_runtime_api.h>

namespace jax_sdpa {

class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace jax_sdpa

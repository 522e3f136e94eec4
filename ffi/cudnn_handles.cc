#include "cudnn_handles.h"

#include <map>
#include <memory>

#include "device_memory.h"

namespace jax_sdpa {
namespace {

struct DeviceHandle {
  std::mutex mutex;
  cudnnHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;  // the stream the handle is bound to
};

ffi::Error CreateHandle(int32_t device, cudnnHandle_t* handle) {
  ScopedDevice scoped(device);
  JAX_SDPA_CUDA_CHECK(scoped.status());
  JAX_SDPA_CUDNN_CHECK(cudnnCreate(handle));
  return ffi::Error::Success();
}

DeviceHandle& HandleForDevice(int32_t device) {
  static std::mutex registry_mutex;
  // Handles live for the whole process: destroying them during interpreter shutdown, after the
  // CUDA context may be gone, is a known source of crashes at exit.
  static auto* registry = new std::map<int32_t, std::unique_ptr<DeviceHandle>>();
  std::lock_guard<std::mutex> guard(registry_mutex);
  auto& slot = (*registry)[device];
  if (!slot) slot = std::make_unique<DeviceHandle>();
  return *slot;
}

}  // namespace

ffi::Error AcquireCudnnHandle(int32_t device, cudaStream_t stream, CudnnHandleLease* lease) {
  DeviceHandle& entry = HandleForDevice(device);
  std::unique_lock<std::mutex> lock(entry.mutex);
  if (entry.handle == nullptr) {
    JAX_SDPA_RETURN_IF_ERROR(CreateHandle(device, &entry.handle));
  }
  if (entry.stream != stream) {  // XLA calls come on one stream per device: rebind rarely
    JAX_SDPA_CUDNN_CHECK(cudnnSetStream(entry.handle, stream));
    entry.stream = stream;
  }
  lease->handle = entry.handle;
  lease->lock = std::move(lock);
  return ffi::Error::Success();
}

}  // namespace jax_sdpa

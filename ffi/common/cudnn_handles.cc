#include "common/cudnn_handles.h"

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "common/device_memory.h"

namespace jax_sdpa {
namespace {

struct IdleHandle {
  cudnnHandle_t handle;
  cudaStream_t stream;  // the stream it was last bound to: rebinding is skipped when it matches
};

// Handles live for the whole process: destroying them during interpreter shutdown, after the
// CUDA context may be gone, is a known source of crashes at exit.
struct Pool {
  std::mutex mutex;
  std::map<int32_t, std::vector<IdleHandle>> idle;  // per device
};

Pool& GlobalPool() {
  static auto* pool = new Pool();
  return *pool;
}

ffi::ErrorOr<cudnnHandle_t> CreateHandle(int32_t device) {
  ScopedDevice scoped(device);
  JAX_SDPA_CUDA_CHECK(scoped.status());
  cudnnHandle_t handle = nullptr;
  JAX_SDPA_CUDNN_CHECK(cudnnCreate(&handle));
  return handle;
}

}  // namespace

ffi::ErrorOr<BorrowedCudnnHandle> BorrowedCudnnHandle::Borrow(int32_t device,
                                                             cudaStream_t stream) {
  IdleHandle taken{nullptr, nullptr};
  {
    Pool& pool = GlobalPool();
    std::lock_guard<std::mutex> guard(pool.mutex);
    std::vector<IdleHandle>& idle = pool.idle[device];
    // Prefer a handle already bound to this stream (XLA uses one compute stream per device).
    for (size_t i = idle.size(); i-- > 0;) {
      if (idle[i].stream == stream || i == 0) {
        taken = idle[i];
        idle.erase(idle.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
  }
  if (taken.handle == nullptr) {
    JAX_SDPA_ASSIGN_OR_RETURN(taken.handle, CreateHandle(device));
  }
  BorrowedCudnnHandle borrowed(device, taken.handle, taken.stream);
  if (taken.stream != stream) {
    JAX_SDPA_CUDNN_CHECK(cudnnSetStream(taken.handle, stream));
    borrowed.stream_ = stream;
  }
  return borrowed;
}

BorrowedCudnnHandle::BorrowedCudnnHandle(BorrowedCudnnHandle&& other) noexcept
    : device_(other.device_), handle_(other.handle_), stream_(other.stream_) {
  other.handle_ = nullptr;
}

BorrowedCudnnHandle::~BorrowedCudnnHandle() {
  if (handle_ == nullptr) return;
  Pool& pool = GlobalPool();
  std::lock_guard<std::mutex> guard(pool.mutex);
  pool.idle[device_].push_back(IdleHandle{handle_, stream_});
}

}  // namespace jax_sdpa

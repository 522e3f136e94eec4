#include "poison_rows.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "capture_mode.h"
#include "check.h"

namespace jax_sdpa {
namespace {

// One block per row; a row whose flag is set gets every 32-bit word of its first token
// written as 0xFFFFFFFF. PTX (no CUDA compiler needed to build us), JIT-compiled by the driver
// for the GPU at hand; ISA 7.0 / sm_80 so that any driver that runs cuDNN's kernels takes it.
constexpr char kPoisonRowsPtx[] = R"(
.version 7.0
.target sm_80
.address_size 64

.visible .entry jax_sdpa_poison_rows(
    .param .u64 flags,
    .param .u64 base,
    .param .u64 row_stride_words,
    .param .u32 row_words)
{
    .reg .pred %p<3>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [flags];
    ld.param.u64 %rd2, [base];
    ld.param.u64 %rd3, [row_stride_words];
    ld.param.u32 %r1, [row_words];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u32 %r2, %ctaid.x;
    mul.wide.u32 %rd4, %r2, 4;
    add.s64 %rd4, %rd1, %rd4;
    ld.global.u32 %r3, [%rd4];
    setp.eq.s32 %p1, %r3, 0;
    @%p1 bra DONE;
    cvt.u64.u32 %rd5, %r2;
    mul.lo.s64 %rd5, %rd5, %rd3;
    shl.b64 %rd5, %rd5, 2;
    add.s64 %rd5, %rd2, %rd5;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %ntid.x;
LOOP:
    setp.ge.u32 %p2, %r4, %r1;
    @%p2 bra DONE;
    mul.wide.u32 %rd6, %r4, 4;
    add.s64 %rd7, %rd5, %rd6;
    st.global.u32 [%rd7], 0xFFFFFFFF;
    add.s32 %r4, %r4, %r5;
    bra LOOP;
DONE:
    ret;
}
)";

struct PoisonKernel {
  cudaError_t status = cudaSuccess;
  cudaKernel_t kernel = nullptr;
};

// Loaded once per process (the library stays loaded for the process's life), and into each
// device's context before its first launch there: the first call may come while XLA captures
// the stream, where a lazy load at launch is not a stream operation it may record.
PoisonKernel LoadedKernel(int device) {
  static PoisonKernel loaded;
  static std::once_flag once;
  static std::atomic<bool> on_device[64] = {};
  RelaxedCaptureMode relaxed;
  std::call_once(once, [] {
    cudaLibrary_t library = nullptr;
    loaded.status = cudaLibraryLoadData(&library, kPoisonRowsPtx, nullptr, nullptr, 0, nullptr,
                                        nullptr, 0);
    if (loaded.status == cudaSuccess) {
      loaded.status = cudaLibraryGetKernel(&loaded.kernel, library, "jax_sdpa_poison_rows");
    }
  });
  if (loaded.status == cudaSuccess && device >= 0 && device < 64 && !on_device[device]) {
    cudaFuncAttributes attributes;
    cudaError_t status =
        cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(loaded.kernel));
    if (status != cudaSuccess) return PoisonKernel{status, nullptr};
    on_device[device] = true;
  }
  return loaded;
}

}  // namespace

ffi::Error PoisonFirstTokens(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& flags,
                             ffi::AnyBuffer buffer) {
  auto dims = buffer.dimensions();
  if (dims.size() < 3) return InvalidArgument("rows to poison need a token axis");
  int64_t rows = 1;
  for (size_t i = 0; i + 3 < dims.size(); ++i) rows *= dims[i];
  int64_t token_elements = dims[dims.size() - 2] * dims[dims.size() - 1];
  int64_t token_bytes = static_cast<int64_t>(buffer.size_bytes()) /
                        std::max<int64_t>(1, rows * dims[dims.size() - 3]);
  if (flags.element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(flags.element_count()) != rows) {
    return InvalidArgument("the rows to poison must be int32 [" + std::to_string(rows) +
                           "], got " + std::to_string(flags.element_count()) + " elements");
  }
  if (rows == 0 || token_elements == 0 || dims[dims.size() - 3] == 0) {
    return ffi::Error::Success();
  }
  if (token_bytes % 4 != 0 || token_bytes / 4 > UINT32_MAX) {
    return InvalidArgument("a token of " + std::to_string(token_bytes) +
                           " bytes cannot be poisoned in 32-bit words");
  }
  PoisonKernel loaded = LoadedKernel(device);
  JAX_SDPA_CUDA_CHECK(loaded.status);
  const void* flag_data = flags.untyped_data();
  void* base = buffer.untyped_data();
  uint64_t row_stride_words = static_cast<uint64_t>(token_bytes / 4) * dims[dims.size() - 3];
  uint32_t row_words = static_cast<uint32_t>(token_bytes / 4);
  void* args[] = {&flag_data, &base, &row_stride_words, &row_words};
  JAX_SDPA_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(loaded.kernel),
                                       dim3(static_cast<unsigned>(rows)), dim3(256), args, 0,
                                       stream));
  return ffi::Error::Success();
}

}  // namespace jax_sdpa

#include "call/row_fills.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "common/capture_mode.h"
#include "common/check.h"

namespace jax_sdpa {
namespace {

// PTX (no CUDA compiler needed to build us), JIT-compiled by the driver for the GPU at hand;
// ISA 7.0 / sm_80 so that any driver that runs cuDNN's kernels takes it. Blocks (row, chunk):
// with b = bounds[r * stride + offset] clamped to the row, row r's tokens [b, tokens) (tail
// != 0) or [0, b) get every 32-bit word set to `value`, the row's chunks striding over them.
constexpr char kFillTokensPtx[] = R"(
.version 7.0
.target sm_80
.address_size 64

.visible .entry jax_sdpa_fill_tokens(
    .param .u64 bounds,
    .param .u32 tail,
    .param .u32 stride,
    .param .u32 offset,
    .param .u64 base,
    .param .u64 row_words,
    .param .u32 token_words,
    .param .u32 tokens,
    .param .u32 value)
{
    .reg .pred %p<3>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<14>;

    ld.param.u64 %rd1, [bounds];
    ld.param.u32 %r9, [tail];
    ld.param.u32 %r1, [stride];
    ld.param.u32 %r2, [offset];
    ld.param.u64 %rd3, [base];
    ld.param.u64 %rd4, [row_words];
    ld.param.u32 %r3, [token_words];
    ld.param.u32 %r4, [tokens];
    ld.param.u32 %r5, [value];
    mov.u32 %r6, %ctaid.x;
    mul.wide.u32 %rd5, %r6, %r1;
    cvt.u64.u32 %rd6, %r2;
    add.s64 %rd5, %rd5, %rd6;
    shl.b64 %rd5, %rd5, 2;
    cvta.to.global.u64 %rd7, %rd1;
    add.s64 %rd7, %rd7, %rd5;
    ld.global.u32 %r7, [%rd7];
    max.s32 %r7, %r7, 0;
    min.s32 %r7, %r7, %r4;
    setp.ne.u32 %p1, %r9, 0;
    selp.b32 %r8, %r4, %r7, %p1;
    selp.b32 %r7, %r7, 0, %p1;
    mul.wide.u32 %rd9, %r7, %r3;
    mul.wide.u32 %rd10, %r8, %r3;
    cvt.u64.u32 %rd11, %r6;
    mul.lo.s64 %rd11, %rd11, %rd4;
    shl.b64 %rd11, %rd11, 2;
    cvta.to.global.u64 %rd12, %rd3;
    add.s64 %rd11, %rd12, %rd11;
    mov.u32 %r9, %ctaid.y;
    mov.u32 %r10, %ntid.x;
    mul.wide.u32 %rd12, %r9, %r10;
    mov.u32 %r11, %tid.x;
    cvt.u64.u32 %rd13, %r11;
    add.s64 %rd12, %rd12, %rd13;
    add.s64 %rd9, %rd9, %rd12;
    mov.u32 %r9, %nctaid.y;
    mul.wide.u32 %rd12, %r9, %r10;
LOOP:
    setp.ge.u64 %p2, %rd9, %rd10;
    @%p2 bra DONE;
    shl.b64 %rd13, %rd9, 2;
    add.s64 %rd13, %rd11, %rd13;
    st.global.u32 [%rd13], %r5;
    add.s64 %rd9, %rd9, %rd12;
    bra LOOP;
DONE:
    ret;
}
)";

struct FillKernel {
  cudaError_t status = cudaSuccess;
  cudaKernel_t kernel = nullptr;
};

// Loaded once per process (the library stays loaded for the process's life), and into each
// device's context before its first launch there: the first call may come while XLA captures
// the stream, where a lazy load at launch is not a stream operation it may record. Only those
// first steps relax the thread's capture mode.
FillKernel LoadedKernel(int device) {
  static FillKernel loaded;
  static std::once_flag once;
  static std::atomic<bool> on_device[64] = {};
  std::call_once(once, [] {
    RelaxedCaptureMode relaxed;
    cudaLibrary_t library = nullptr;
    loaded.status = cudaLibraryLoadData(&library, kFillTokensPtx, nullptr, nullptr, 0, nullptr,
                                        nullptr, 0);
    if (loaded.status == cudaSuccess) {
      loaded.status = cudaLibraryGetKernel(&loaded.kernel, library, "jax_sdpa_fill_tokens");
    }
  });
  if (loaded.status == cudaSuccess && device >= 0 && device < 64 && !on_device[device]) {
    RelaxedCaptureMode relaxed;
    cudaFuncAttributes attributes;
    cudaError_t status =
        cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(loaded.kernel));
    if (status != cudaSuccess) return FillKernel{status, nullptr};
    on_device[device] = true;
  }
  return loaded;
}

// A [rows..., tokens, heads, dim] buffer's rows, tokens and bytes per token.
struct TokenLayout {
  int64_t rows = 1;
  int64_t tokens = 0;
  int64_t token_bytes = 0;
};

ffi::ErrorOr<TokenLayout> LayoutOf(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  if (dims.size() < 3) return Failure{InvalidArgument("rows to fill need a token axis")};
  TokenLayout layout;
  for (size_t i = 0; i + 3 < dims.size(); ++i) layout.rows *= dims[i];
  layout.tokens = dims[dims.size() - 3];
  layout.token_bytes = static_cast<int64_t>(buffer.size_bytes()) /
                       std::max<int64_t>(1, layout.rows * layout.tokens);
  if (layout.token_bytes % 4 != 0 || layout.token_bytes / 4 > UINT32_MAX) {
    return Failure{InvalidArgument("a token of " + std::to_string(layout.token_bytes) +
                                   " bytes cannot be filled in 32-bit words")};
  }
  return layout;
}

ffi::Error CheckRowOperand(const Operand& operand, int64_t expected, const char* name) {
  if (operand.element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(operand.element_count()) != expected) {
    return InvalidArgument(std::string(name) + " must be int32 with " +
                           std::to_string(expected) + " elements, got " +
                           std::to_string(operand.element_count()));
  }
  return ffi::Error::Success();
}

// Launches the fill of rows' token ranges (see kFillTokensPtx) over `buffer`.
ffi::Error FillTokens(cudaStream_t stream, int32_t device, const void* bounds, uint32_t tail,
                      uint32_t stride, uint32_t offset, uint32_t value,
                      const TokenLayout& layout, ffi::AnyBuffer buffer) {
  if (layout.rows == 0 || layout.tokens == 0 || layout.token_bytes == 0) {
    return ffi::Error::Success();
  }
  if (layout.tokens > INT32_MAX || layout.rows > INT32_MAX) {
    return InvalidArgument("filling rows' tokens takes at most 2^31 - 1 rows and tokens");
  }
  FillKernel loaded = LoadedKernel(device);
  JAX_SDPA_CUDA_CHECK(loaded.status);
  void* base = buffer.untyped_data();
  uint32_t token_words = static_cast<uint32_t>(layout.token_bytes / 4);
  uint64_t row_words = static_cast<uint64_t>(token_words) * layout.tokens;
  uint32_t tokens = static_cast<uint32_t>(layout.tokens);
  void* args[] = {&bounds, &tail, &stride, &offset, &base, &row_words, &token_words, &tokens,
                  &value};
  // About a thousand blocks over all rows (rows x chunks), at least one chunk per row: enough
  // to fill a whole row at memory speed when a row has no tokens within its length.
  unsigned chunks = static_cast<unsigned>(std::clamp<int64_t>(1024 / layout.rows, 1, 1024));
  JAX_SDPA_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(loaded.kernel),
                                       dim3(static_cast<unsigned>(layout.rows), chunks),
                                       dim3(256), args, 0, stream));
  return ffi::Error::Success();
}

}  // namespace

ffi::Error PoisonFirstTokens(cudaStream_t stream, int32_t device, const Operand& flags,
                             ffi::AnyBuffer buffer) {
  JAX_SDPA_ASSIGN_OR_RETURN(TokenLayout layout, LayoutOf(buffer));
  JAX_SDPA_RETURN_IF_ERROR(CheckRowOperand(flags, layout.rows, "the rows to poison"));
  // Tokens [0, flag) of each row: the first token where the flag is 1.
  return FillTokens(stream, device, flags.untyped_data(), 0, 1, 0, 0xFFFFFFFFu, layout, buffer);
}

ffi::Error ZeroTokenTails(cudaStream_t stream, int32_t device, const Operand& tails,
                          int side, ffi::AnyBuffer buffer) {
  JAX_SDPA_ASSIGN_OR_RETURN(TokenLayout layout, LayoutOf(buffer));
  JAX_SDPA_RETURN_IF_ERROR(CheckRowOperand(tails, 2 * layout.rows, "the rows' tails"));
  return FillTokens(stream, device, tails.untyped_data(), 1, 2, static_cast<uint32_t>(side), 0,
                    layout, buffer);
}

}  // namespace jax_sdpa

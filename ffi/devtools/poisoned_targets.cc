#include "devtools/poisoned_targets.h"

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {
namespace {

XLA_FFI_Handler* product_handlers[kPoisonedSlots] = {};

// Fills every buffer result of an executing call with 0xFF bytes on the call's stream. (XLA's
// metadata query, a call frame without results, passes through untouched.)
XLA_FFI_Error* PoisonResults(XLA_FFI_CallFrame* frame) {
  if (frame->rets.size == 0) return nullptr;
  XLA_FFI_Stream_Get_Args stream_args{XLA_FFI_Stream_Get_Args_STRUCT_SIZE, nullptr, frame->ctx,
                                      nullptr};
  if (XLA_FFI_Error* error = frame->api->XLA_FFI_Stream_Get(&stream_args)) return error;
  auto stream = static_cast<cudaStream_t>(stream_args.stream);
  for (int64_t i = 0; i < frame->rets.size; ++i) {
    if (frame->rets.types[i] != XLA_FFI_RetType_BUFFER) continue;
    auto* buffer = static_cast<XLA_FFI_Buffer*>(frame->rets.rets[i]);
    size_t bytes = xla::ffi::ByteWidth(static_cast<xla::ffi::DataType>(buffer->dtype));
    for (int64_t d = 0; d < buffer->rank; ++d) bytes *= static_cast<size_t>(buffer->dims[d]);
    cudaError_t status = bytes > 0 ? cudaMemsetAsync(buffer->data, 0xFF, bytes, stream)
                                   : cudaSuccess;
    if (status != cudaSuccess) {
      XLA_FFI_Error_Create_Args error_args{XLA_FFI_Error_Create_Args_STRUCT_SIZE, nullptr,
                                           cudaGetErrorString(status), XLA_FFI_Error_Code_INTERNAL};
      return frame->api->XLA_FFI_Error_Create(&error_args);
    }
  }
  return nullptr;
}

template <int kSlot>
XLA_FFI_Error* Poisoned(XLA_FFI_CallFrame* frame) {
  if (frame->stage == XLA_FFI_ExecutionStage_EXECUTE) {
    if (XLA_FFI_Error* error = PoisonResults(frame)) return error;
  }
  return product_handlers[kSlot](frame);
}

template <int... kSlots>
constexpr std::array<XLA_FFI_Handler*, sizeof...(kSlots)> PoisonedHandlers(
    std::integer_sequence<int, kSlots...>) {
  return {Poisoned<kSlots>...};
}
constexpr auto kPoisoned = PoisonedHandlers(std::make_integer_sequence<int, kPoisonedSlots>());

}  // namespace

XLA_FFI_Handler* PoisonedHandler(int slot) { return kPoisoned[slot]; }

void SetPoisonedTarget(int slot, XLA_FFI_Handler* product) { product_handlers[slot] = product; }

}  // namespace jax_sdpa

// Turn CUDA / cuDNN / cuDNN-frontend failures into xla::ffi::Error values that carry the library's
// own message and where it happened; nothing here aborts the process.
#pragma once

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {

namespace ffi = xla::ffi;

inline std::string SourceLocation(const char* file, int line) {
  return std::string(file) + ":" + std::to_string(line);
}

inline ffi::Error CudaError(cudaError_t status, const char* expr, const char* file, int line) {
  return ffi::Error::Internal(std::string("CUDA error ") + cudaGetErrorName(status) + " (" +
                              cudaGetErrorString(status) + ") in " + expr + " at " +
                              SourceLocation(file, line));
}

inline ffi::Error CudnnError(cudnnStatus_t status, const char* expr, const char* file, int line) {
  char detail[512] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  return ffi::Error::Internal(std::string("cuDNN error ") + cudnnGetErrorString(status) + " in " +
                              expr + " at " + SourceLocation(file, line) +
                              (detail[0] ? std::string(": ") + detail : std::string()));
}

// A failed step, returned from a function that returns ffi::Error or ffi::ErrorOr<T> alike.
struct Failure {
  ffi::Error error;
  operator ffi::Error() && { return std::move(error); }  // NOLINT: implicit by design
  template <typename T>
  operator ffi::ErrorOr<T>() && {  // NOLINT
    return ffi::Unexpected<ffi::Error>(std::move(error));
  }
};

inline ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error::InvalidArgument("jax_sdpa: " + message);
}

}  // namespace jax_sdpa

#define JAX_SDPA_CONCAT_INNER(a, b) a##b
#define JAX_SDPA_CONCAT(a, b) JAX_SDPA_CONCAT_INNER(a, b)

#define JAX_SDPA_RETURN_IF_ERROR(expr)                          \
  do {                                                          \
    ::xla::ffi::Error jax_sdpa_error_ = (expr);                 \
    if (jax_sdpa_error_.failure()) {                            \
      return ::jax_sdpa::Failure{std::move(jax_sdpa_error_)};   \
    }                                                           \
  } while (0)

// `lhs = *expr` for an ffi::ErrorOr<T> expr, or returns its error.
#define JAX_SDPA_ASSIGN_OR_RETURN(lhs, expr)                                              \
  auto JAX_SDPA_CONCAT(jax_sdpa_result_, __LINE__) = (expr);                              \
  if (!JAX_SDPA_CONCAT(jax_sdpa_result_, __LINE__).has_value()) {                          \
    return ::jax_sdpa::Failure{std::move(JAX_SDPA_CONCAT(jax_sdpa_result_, __LINE__)).error()}; \
  }                                                                                       \
  lhs = std::move(*JAX_SDPA_CONCAT(jax_sdpa_result_, __LINE__))

// Returns the error `to_error` makes of expr's status unless it is `success`.
#define JAX_SDPA_STATUS_CHECK(status_type, success, to_error, expr)                    \
  do {                                                                                \
    status_type jax_sdpa_status_ = (expr);                                            \
    if (jax_sdpa_status_ != (success)) {                                              \
      return ::jax_sdpa::Failure{to_error(jax_sdpa_status_, #expr, __FILE__, __LINE__)}; \
    }                                                                                 \
  } while (0)

#define JAX_SDPA_CUDA_CHECK(expr) \
  JAX_SDPA_STATUS_CHECK(cudaError_t, cudaSuccess, ::jax_sdpa::CudaError, expr)
#define JAX_SDPA_CUDNN_CHECK(expr) \
  JAX_SDPA_STATUS_CHECK(cudnnStatus_t, CUDNN_STATUS_SUCCESS, ::jax_sdpa::CudnnError, expr)

// One operand as a call's planning reads it: its dtype, dims and (in a handler) its data. The
// handlers view XLA's buffers this way; the trace-time workspace planner describes operands
// without data, so both plan a call with the same code (targets/planners.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/check.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {

class Operand {
 public:
  Operand(ffi::DataType type, ffi::Span<const int64_t> dims, void* data = nullptr)
      : type_(type), dims_(dims), data_(data) {}
  // A view of XLA's buffer (implicit: every buffer is an operand).
  Operand(const ffi::AnyBuffer& buffer)  // NOLINT(google-explicit-constructor)
      : Operand(buffer.element_type(), buffer.dimensions(), buffer.untyped_data()) {}

  ffi::DataType element_type() const { return type_; }
  ffi::Span<const int64_t> dimensions() const { return dims_; }
  size_t element_count() const {
    size_t count = 1;
    for (int64_t d : dims_) count *= static_cast<size_t>(d);
    return count;
  }
  size_t size_bytes() const { return ffi::ByteWidth(type_) * element_count(); }
  void* untyped_data() const { return data_; }

 private:
  ffi::DataType type_;
  ffi::Span<const int64_t> dims_;
  void* data_;
};

}  // namespace jax_sdpa

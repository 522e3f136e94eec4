// Our FFI targets as jax_sdpa/cudnn/targets.py declares them, one per job and direction: each
// target's attribute struct (its graph options, then its own attributes), its decoding, and
// TargetTraits<Attributes> (its names, the readers of its operands by the declared order, the
// copy of its graph options into an SdpaConfig), generated into targets.inc at build time
// (cmake/generate_targets.py). The handlers (dense.cc, ragged.cc, paged.cc, fp8.cc) bind
// exactly their target's operands and attributes through these.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/check.h"
#include "common/operand.h"
#include "graph/sdpa_config.h"
#include "target_lists.inc"  // generated

namespace jax_sdpa {

// A call's operands and results by the names targets.py gives them; a target fills those it
// binds.
#define JAX_SDPA_OPERAND_FIELD(name) std::optional<Operand> name;
#define JAX_SDPA_RESULT_FIELD(name) std::optional<ffi::AnyBuffer> name;
struct CallOperands {
  JAX_SDPA_OPERAND_NAMES(JAX_SDPA_OPERAND_FIELD)
};
struct CallResults {
  JAX_SDPA_RESULT_NAMES(JAX_SDPA_RESULT_FIELD)
};
#undef JAX_SDPA_OPERAND_FIELD
#undef JAX_SDPA_RESULT_FIELD

template <typename Attributes>
struct TargetTraits;

// A call's attribute values by name, as Python describes a call it plans: numbers (each exact
// in a double: bools, small integers, float32 values) and strings.
struct AttributeValues {
  std::map<std::string, double> numbers;
  std::map<std::string, std::string> strings;
};

template <typename Value>
ffi::ErrorOr<Value> FindAttribute(const std::map<std::string, Value>& values, const char* target,
                                  const char* name) {
  auto found = values.find(name);
  if (found == values.end()) {
    return Failure{InvalidArgument(std::string(target) + ": the attribute " + name +
                                   " is missing")};
  }
  return found->second;
}

inline ffi::ErrorOr<double> AttributeValue(const AttributeValues& values, const char* target,
                                           const char* name) {
  return FindAttribute(values.numbers, target, name);
}

// A view of the string in `values`.
inline ffi::ErrorOr<std::string_view> StringAttributeValue(const AttributeValues& values,
                                                           const char* target,
                                                           const char* name) {
  auto found = values.strings.find(name);
  if (found == values.strings.end()) {
    return Failure{InvalidArgument(std::string(target) + ": the string attribute " + name +
                                   " is missing")};
  }
  return std::string_view(found->second);
}

}  // namespace jax_sdpa

#include "targets.inc"  // generated

// A handler's buffers as its target declares them: parameters, and the binding's Arg/Ret.
#define JAX_SDPA_ARG_PARAMETER(name) ::xla::ffi::AnyBuffer name,
#define JAX_SDPA_RET_PARAMETER(name) ::xla::ffi::Result<::xla::ffi::AnyBuffer> name,
#define JAX_SDPA_BIND_ARG(name) .Arg<::xla::ffi::AnyBuffer>()
#define JAX_SDPA_BIND_RET(name) .Ret<::xla::ffi::AnyBuffer>()
#define JAX_SDPA_KEEP_ARG(name) operands.name = Operand(name);
#define JAX_SDPA_KEEP_RET(name) results.name = *name;

// The cuDNN workspace a call needs, asked while Python traces it (so that XLA can allocate the
// workspace as one of the call's results): the target's own planner, on described operands.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "call/target.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {

// An operand as Python describes it when it plans a call: dtype name ("bfloat16", "int32", ...)
// and dims.
struct OperandShape {
  std::string dtype;
  std::vector<int64_t> dims;
};

// The cuDNN workspace in bytes a call of `target` (its name or its handler's) with these
// operands (in the target's order) and attribute values (by name) needs on `device`, whose
// graph this builds, or finds in the process's cache; the call then finds it there. An error
// carries the planner's or cuDNN's message.
xla::ffi::ErrorOr<int64_t> PlannedWorkspaceBytes(const std::string& target, int32_t device,
                                                 const std::vector<OperandShape>& operands,
                                                 const AttributeValues& values);

}  // namespace jax_sdpa

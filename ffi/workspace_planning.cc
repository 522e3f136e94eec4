#include "workspace_planning.h"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "call_plan.h"
#include "cudnn_handles.h"
#include "graph_cache.h"
#include "sdpa_graphs.h"

namespace jax_sdpa {
namespace {

ffi::ErrorOr<ffi::DataType> DataTypeNamed(const std::string& name) {
  static const std::map<std::string, ffi::DataType> kTypes = {
      {"float16", ffi::DataType::F16}, {"bfloat16", ffi::DataType::BF16},
      {"float32", ffi::DataType::F32}, {"int32", ffi::DataType::S32},
      {"uint32", ffi::DataType::U32}, {"float8_e4m3fn", ffi::DataType::F8E4M3FN},
      {"float8_e5m2", ffi::DataType::F8E5M2},
  };
  auto found = kTypes.find(name);
  if (found == kTypes.end()) return Failure{InvalidArgument("no operand is of dtype " + name)};
  return found->second;
}

}  // namespace

ffi::ErrorOr<int64_t> PlannedWorkspaceBytes(bool backward, int32_t device,
                                            const std::vector<OperandShape>& operands,
                                            const std::map<std::string, double>& values) {
  try {
    JAX_SDPA_ASSIGN_OR_RETURN(CallAttributes attributes, AttributesFromValues(values));
    size_t fixed = backward ? 6 : 3;  // q, k, v (and o, stats, d_o)
    if (operands.size() < fixed) {
      return Failure{InvalidArgument("expected at least " + std::to_string(fixed) +
                                     " operands, got " + std::to_string(operands.size()))};
    }
    // Operands without data: planning reads only dtypes and dims.
    std::vector<Operand> described;
    for (const OperandShape& operand : operands) {
      JAX_SDPA_ASSIGN_OR_RETURN(ffi::DataType type, DataTypeNamed(operand.dtype));
      described.emplace_back(type, ffi::Span<const int64_t>(operand.dims.data(),
                                                            operand.dims.size()));
    }
    auto buffer = [&](size_t i) { return described[i]; };
    JAX_SDPA_ASSIGN_OR_RETURN(
        OptionalInputs optional,
        ReadOptionalInputs(
            operands.size() - fixed,
            [&](size_t i) -> ffi::ErrorOr<Operand> { return buffer(fixed + i); }, attributes));
    Direction direction = backward ? Direction::kBackward : Direction::kForward;
    JAX_SDPA_ASSIGN_OR_RETURN(CallPlan plan,
                              PlanAnyCall(direction, device, buffer(0), buffer(1), buffer(2),
                                          std::move(optional), attributes));
    ScopedDevice scoped(device);
    JAX_SDPA_CUDA_CHECK(scoped.status());
    JAX_SDPA_ASSIGN_OR_RETURN(BorrowedCudnnHandle handle,
                              BorrowedCudnnHandle::Borrow(device, nullptr));
    JAX_SDPA_ASSIGN_OR_RETURN(std::shared_ptr<SdpaGraph> graph,
                              GraphCache::Global().GetOrBuild(plan.config, handle.get()));
    return graph->workspace_size();
  } catch (const std::exception& e) {
    return Failure{ffi::Error::Internal(std::string("jax_sdpa planning: ") + e.what())};
  }
}

}  // namespace jax_sdpa

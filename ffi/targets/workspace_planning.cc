#include "targets/workspace_planning.h"

#include <exception>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/cudnn_handles.h"
#include "common/device_memory.h"
#include "graph/graph_cache.h"
#include "graph/sdpa_graphs.h"
#include "targets/planners.h"

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

// The plan of a call of the target whose attributes are `Attributes`, from described operands
// (no data: planning reads only dtypes and dims).
template <typename Attributes>
ffi::ErrorOr<CallPlan> PlanDescribed(int32_t device, const std::vector<Operand>& described,
                                     const AttributeValues& values) {
  using Traits = TargetTraits<Attributes>;
  JAX_SDPA_ASSIGN_OR_RETURN(Attributes attributes, Traits::FromValues(values));
  if (described.size() < Traits::kOperands) {
    return Failure{InvalidArgument(std::string(Traits::kName) + ": expected at least " +
                                   std::to_string(Traits::kOperands) + " operands, got " +
                                   std::to_string(described.size()))};
  }
  CallOperands operands;
  auto get = [&](size_t i) -> ffi::ErrorOr<Operand> { return described[i]; };
  JAX_SDPA_RETURN_IF_ERROR(Traits::ReadOperands(get, operands));
  JAX_SDPA_RETURN_IF_ERROR(Traits::ReadOptional(
      described.size() - Traits::kOperands,
      [&](size_t i) { return get(Traits::kOperands + i); }, attributes, operands));
  return Plan(device, std::move(operands), attributes);
}

ffi::ErrorOr<CallPlan> PlanTarget(const std::string& target, int32_t device,
                                  const std::vector<Operand>& described,
                                  const AttributeValues& values) {
#define JAX_SDPA_PLAN_IF_NAMED(Handler)                                        \
  if (target == TargetTraits<Handler##Attributes>::kName ||                    \
      target == TargetTraits<Handler##Attributes>::kHandler) {                 \
    return PlanDescribed<Handler##Attributes>(device, described, values);      \
  }
  JAX_SDPA_TARGETS(JAX_SDPA_PLAN_IF_NAMED)
#undef JAX_SDPA_PLAN_IF_NAMED
  return Failure{InvalidArgument("no target is named " + target)};
}

}  // namespace

ffi::ErrorOr<int64_t> PlannedWorkspaceBytes(const std::string& target, int32_t device,
                                            const std::vector<OperandShape>& operands,
                                            const AttributeValues& values) {
  try {
    std::vector<Operand> described;
    for (const OperandShape& operand : operands) {
      JAX_SDPA_ASSIGN_OR_RETURN(ffi::DataType type, DataTypeNamed(operand.dtype));
      described.emplace_back(type, ffi::Span<const int64_t>(operand.dims.data(),
                                                            operand.dims.size()));
    }
    JAX_SDPA_ASSIGN_OR_RETURN(CallPlan plan, PlanTarget(target, device, described, values));
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

#include "sdpa_handlers.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "call_attributes.h"
#include "call_plan.h"
#include "call_state.h"
#include "check.h"
#include "cudnn_handles.h"
#include "graph_cache.h"
#include "row_fills.h"
#include "sdpa_config.h"
#include "sdpa_graphs.h"

// The handlers decode their attributes into one struct, by name.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_sdpa::CallAttributes,
                                      JAX_SDPA_ATTRIBUTES(JAX_SDPA_DECODE, JAX_SDPA_COMMA));

namespace jax_sdpa {
namespace {

// Zero-fills an output before cuDNN runs where cuDNN may leave elements unwritten (padding,
// tokens of no document).
ffi::Error ZeroFill(cudaStream_t stream, bool zero, ffi::AnyBuffer buffer) {
  if (zero) {
    JAX_SDPA_CUDA_CHECK(cudaMemsetAsync(buffer.untyped_data(), 0, buffer.size_bytes(), stream));
  }
  return ffi::Error::Success();
}

// Whether an output that zero_tails does not cover (stats, dbias) is zero-filled first.
bool ZeroFirst(const CallAttributes& attributes) {
  return attributes.zero_outputs || attributes.zero_tails;
}

ffi::ErrorOr<void*> AllocateWorkspace(ffi::ScratchAllocator& scratch, const SdpaGraph& graph) {
  if (graph.workspace_size() == 0) return static_cast<void*>(nullptr);
  // Allocate(size) with the default alignment: XLA's allocations are 256-byte aligned anyway,
  // and an explicit alignment argument returned nothing on JAX 0.11.2 (docs/DEVELOPING.md).
  std::optional<void*> memory = scratch.Allocate(static_cast<size_t>(graph.workspace_size()));
  if (!memory.has_value() || *memory == nullptr) {
    return Failure{ffi::Error(ffi::ErrorCode::kResourceExhausted,
                              "jax_sdpa: could not allocate " +
                                  std::to_string(graph.workspace_size()) +
                                  " bytes of cuDNN workspace for " + graph.config().ToString())};
  }
  return *memory;
}

// What a call runs with: a handle bound to its stream, its graph and its workspace.
struct PreparedCall {
  BorrowedCudnnHandle handle;
  std::shared_ptr<SdpaGraph> graph;
  void* workspace = nullptr;
};

// Finds the call's graph (in its executable's state, else the cache, else builds it) and its
// workspace: the one XLA allocated as the call's last result when Python sized it while
// planning the call (PlannedWorkspaceBytes), which XLA reuses like any temporary and orders
// like any buffer, in a command buffer too. Without one (no GPU while planning, or a graph
// needing more than planned), per-call scratch; but a call recorded into a command buffer
// replays after it returns, so it takes its own workspace for the executable's life
// (call_state.h).
ffi::ErrorOr<PreparedCall> PrepareCall(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                                       CallState& state, const SdpaConfig& config,
                                       const CallAttributes& attributes,
                                       const std::optional<ffi::AnyBuffer>& given_workspace) {
  JAX_SDPA_ASSIGN_OR_RETURN(BorrowedCudnnHandle handle,
                            BorrowedCudnnHandle::Borrow(config.device, stream));
  PreparedCall prepared{std::move(handle), nullptr, nullptr};
  GraphCache& cache = GraphCache::Global();
  cache.SweepIfPending(config.device, stream);
  prepared.graph = state.Find(config);
  if (prepared.graph) {
    cache.CountHit();
  } else {
    JAX_SDPA_ASSIGN_OR_RETURN(prepared.graph, cache.GetOrBuild(config, prepared.handle.get()));
    state.Remember(prepared.graph);
  }
  int64_t needed = prepared.graph->workspace_size();
  if (needed == 0) return prepared;
  if (given_workspace && static_cast<int64_t>(given_workspace->size_bytes()) >= needed) {
    prepared.workspace = given_workspace->untyped_data();
  } else if (attributes.command_buffer) {
    JAX_SDPA_RETURN_IF_ERROR(state.OwnWorkspace(*prepared.graph, &prepared.workspace));
  } else {
    JAX_SDPA_ASSIGN_OR_RETURN(prepared.workspace, AllocateWorkspace(scratch, *prepared.graph));
  }
  return prepared;
}

// The workspace XLA allocated as the call's result `index` among the remaining ones, if the
// call has one.
ffi::ErrorOr<std::optional<ffi::AnyBuffer>> GivenWorkspace(ffi::RemainingRets& extra,
                                                           size_t index,
                                                           const CallAttributes& attributes) {
  if (!attributes.workspace_result) return std::optional<ffi::AnyBuffer>();
  auto result = extra.get<ffi::AnyBuffer>(index);
  if (!result.has_value()) return Failure{result.error()};
  return std::optional<ffi::AnyBuffer>(**result);
}

// A ragged call whose grid the device chose (device_grid): its numbers copied to the host,
// which waits for the stream, then the plan's config made that grid's (or its fallback's,
// ApplyGrid). Such a call cannot be recorded into a command buffer, where nothing may wait.
ffi::Error ReadGrid(cudaStream_t stream, const CallAttributes& attributes, CallPlan& plan) {
  if (!plan.optional.grid) return ffi::Error::Success();
  if (attributes.command_buffer) {
    return ffi::Error::InvalidArgument("jax_sdpa: a device grid cannot be recorded");
  }
  std::vector<int32_t> grid(plan.optional.grid->element_count());
  JAX_SDPA_CUDA_CHECK(cudaMemcpyAsync(grid.data(), plan.optional.grid->untyped_data(),
                                      plan.optional.grid->size_bytes(), cudaMemcpyDeviceToHost,
                                      stream));
  JAX_SDPA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return ApplyGrid(grid, plan);
}

// XLA's dtype of each ElementType, in its order.
ffi::DataType BufferType(ElementType type) {
  static constexpr ffi::DataType kTypes[] = {ffi::DataType::F16, ffi::DataType::BF16,
                                             ffi::DataType::F8E4M3FN, ffi::DataType::F8E5M2};
  return kTypes[static_cast<int32_t>(type)];
}

// An FP8 call's amaxes: the remaining result `index`, float32 [..., count, kFp8ScaleRow].
ffi::ErrorOr<std::optional<ffi::AnyBuffer>> Fp8Amaxes(ffi::RemainingRets& extra, size_t index,
                                                      const CallPlan& plan) {
  if (!IsFp8(plan.config.element_type)) return std::optional<ffi::AnyBuffer>();
  auto result = extra.get<ffi::AnyBuffer>(index);
  if (!result.has_value()) return Failure{result.error()};
  ffi::AnyBuffer amaxes = **result;
  int64_t expected = plan.repeats * Fp8AmaxCount(plan.config.direction) * kFp8ScaleRow;
  if (amaxes.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(amaxes.element_count()) != expected) {
    return Failure{InvalidArgument("FP8 amaxes must be float32 [" +
                                   std::to_string(Fp8AmaxCount(plan.config.direction)) + ", " +
                                   std::to_string(kFp8ScaleRow) + "] per call")};
  }
  return std::optional<ffi::AnyBuffer>(amaxes);
}

// Pointer to the r-th of `repeats` equal slices of a buffer.
const void* Slice(const Operand& buffer, int64_t r, int64_t repeats) {
  return static_cast<const char*>(buffer.untyped_data()) + r * (buffer.size_bytes() / repeats);
}
void* MutableSlice(ffi::AnyBuffer buffer, int64_t r, int64_t repeats) {
  return static_cast<char*>(buffer.untyped_data()) + r * (buffer.size_bytes() / repeats);
}

AttentionInputs InputsSlice(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                            const ffi::AnyBuffer& v, const CallPlan& plan, int64_t r) {
  const OptionalInputs& optional = plan.optional;
  int64_t repeats = plan.repeats;
  AttentionInputs in;
  in.q = Slice(q, r, repeats);
  in.k = Slice(k, r, repeats);
  in.v = Slice(v, r, repeats);
  if (optional.bias) in.bias = Slice(*optional.bias, r, repeats);
  if (optional.q_lengths) {
    in.q_lengths = Slice(*optional.q_lengths, r, repeats);
    in.kv_lengths = Slice(*optional.kv_lengths, r, repeats);
  }
  if (optional.q_segment_ids) {
    in.q_segment_ids = Slice(*optional.q_segment_ids, r, repeats);
    in.kv_segment_ids = Slice(*optional.kv_segment_ids, r, repeats);
  }
  if (optional.offsets) {
    const int32_t* rows = static_cast<const int32_t*>(Slice(*optional.offsets, r, repeats));
    in.offsets = {rows, rows + plan.offsets_row, rows + 2 * plan.offsets_row,
                  rows + 3 * plan.offsets_row, rows + 4 * plan.offsets_row};
  }
  if (optional.page_table) in.page_table = optional.page_table->untyped_data();
  if (optional.dropout_seed) in.dropout_seed = Slice(*optional.dropout_seed, r, repeats);
  return in;
}

Fp8Buffers Fp8Slice(const CallPlan& plan, const std::optional<ffi::AnyBuffer>& amaxes,
                    int64_t r) {
  if (!amaxes) return {};
  return {static_cast<const float*>(Slice(*plan.optional.fp8_scales, r, plan.repeats)),
          static_cast<float*>(MutableSlice(*amaxes, r, plan.repeats))};
}

ffi::Error SdpaForward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                       CallState* state, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> o,
                       ffi::Result<ffi::AnyBuffer> stats, ffi::RemainingRets extra_results,
                       CallAttributes attributes) {
  try {
    JAX_SDPA_ASSIGN_OR_RETURN(OptionalInputs optional, ReadOptionalInputs(rest, attributes));
    JAX_SDPA_ASSIGN_OR_RETURN(CallPlan plan, PlanAnyCall(Direction::kForward, device, q, k, v,
                                                         std::move(optional), attributes));
    JAX_SDPA_RETURN_IF_ERROR(ReadGrid(stream, attributes, plan));
    const SdpaConfig& c = plan.config;
    JAX_SDPA_RETURN_IF_ERROR(CheckShape(*o, q.element_type(), OutputDims(q, c), "output"));
    JAX_SDPA_RETURN_IF_ERROR(CheckShape(*stats, ffi::DataType::F32, StatsDims(q, c), "stats"));
    // With zero_tails the tokens past the lengths are zeroed after cuDNN ran; the stats, small,
    // are zero-filled first either way.
    JAX_SDPA_RETURN_IF_ERROR(ZeroFill(stream, attributes.zero_outputs, *o));
    JAX_SDPA_RETURN_IF_ERROR(ZeroFill(stream, ZeroFirst(attributes), *stats));
    JAX_SDPA_ASSIGN_OR_RETURN(std::optional<ffi::AnyBuffer> amaxes,
                              Fp8Amaxes(extra_results, 0, plan));
    JAX_SDPA_ASSIGN_OR_RETURN(std::optional<ffi::AnyBuffer> workspace,
                              GivenWorkspace(extra_results, amaxes ? 1 : 0, attributes));
    JAX_SDPA_ASSIGN_OR_RETURN(PreparedCall call,
                              PrepareCall(stream, scratch, *state, c, attributes, workspace));
    for (int64_t r = 0; r < plan.repeats; ++r) {
      ForwardBuffers buffers;
      buffers.in = InputsSlice(q, k, v, plan, r);
      buffers.o = MutableSlice(*o, r, plan.repeats);
      buffers.stats = MutableSlice(*stats, r, plan.repeats);
      buffers.fp8 = Fp8Slice(plan, amaxes, r);
      JAX_SDPA_RETURN_IF_ERROR(
          call.graph->ExecuteForward(call.handle.get(), buffers, call.workspace));
    }
    if (plan.optional.tails) {
      JAX_SDPA_RETURN_IF_ERROR(ZeroTokenTails(stream, device, *plan.optional.tails, 0, *o));
    }
    if (plan.optional.poison_rows) {
      JAX_SDPA_RETURN_IF_ERROR(PoisonFirstTokens(stream, device, *plan.optional.poison_rows, *o));
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_sdpa forward: ") + e.what());
  }
}

ffi::Error SdpaBackward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                        CallState* state, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer o, ffi::AnyBuffer stats, ffi::AnyBuffer d_o,
                        ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::RemainingRets extra_results, CallAttributes attributes) {
  try {
    JAX_SDPA_ASSIGN_OR_RETURN(OptionalInputs optional, ReadOptionalInputs(rest, attributes));
    JAX_SDPA_ASSIGN_OR_RETURN(CallPlan plan, PlanAnyCall(Direction::kBackward, device, q, k, v,
                                                         std::move(optional), attributes));
    JAX_SDPA_RETURN_IF_ERROR(ReadGrid(stream, attributes, plan));
    const SdpaConfig& c = plan.config;
    JAX_SDPA_RETURN_IF_ERROR(CheckShape(o, q.element_type(), OutputDims(q, c), "output"));
    ffi::DataType gradient_type = BufferType(c.gradient_type);
    JAX_SDPA_RETURN_IF_ERROR(
        CheckShape(d_o, gradient_type, OutputDims(q, c), "output cotangent"));
    JAX_SDPA_RETURN_IF_ERROR(CheckShape(stats, ffi::DataType::F32, StatsDims(q, c), "stats"));
    JAX_SDPA_RETURN_IF_ERROR(
        CheckShape(*dq, gradient_type, ToVector(q.dimensions()), "query gradient"));
    JAX_SDPA_RETURN_IF_ERROR(
        CheckShape(*dk, gradient_type, ToVector(k.dimensions()), "key gradient"));
    JAX_SDPA_RETURN_IF_ERROR(
        CheckShape(*dv, gradient_type, ToVector(v.dimensions()), "value gradient"));
    std::optional<ffi::AnyBuffer> dbias;
    if (c.bias_grad) {
      auto result = extra_results.get<ffi::AnyBuffer>(0);
      if (!result.has_value()) return result.error();
      dbias = **result;
      const Operand& bias = *plan.optional.bias;
      JAX_SDPA_RETURN_IF_ERROR(CheckShape(*dbias, bias.element_type(),
                                          ToVector(bias.dimensions()), "bias gradient"));
      JAX_SDPA_RETURN_IF_ERROR(ZeroFill(stream, ZeroFirst(attributes), *dbias));
    }
    for (ffi::AnyBuffer out : {*dq, *dk, *dv}) {
      JAX_SDPA_RETURN_IF_ERROR(ZeroFill(stream, attributes.zero_outputs, out));
    }
    size_t next_result = dbias ? 1 : 0;
    JAX_SDPA_ASSIGN_OR_RETURN(std::optional<ffi::AnyBuffer> amaxes,
                              Fp8Amaxes(extra_results, next_result, plan));
    if (amaxes) ++next_result;
    JAX_SDPA_ASSIGN_OR_RETURN(std::optional<ffi::AnyBuffer> workspace,
                              GivenWorkspace(extra_results, next_result, attributes));
    JAX_SDPA_ASSIGN_OR_RETURN(PreparedCall call,
                              PrepareCall(stream, scratch, *state, c, attributes, workspace));
    for (int64_t r = 0; r < plan.repeats; ++r) {
      BackwardBuffers buffers;
      buffers.in = InputsSlice(q, k, v, plan, r);
      buffers.o = Slice(o, r, plan.repeats);
      buffers.d_o = Slice(d_o, r, plan.repeats);
      buffers.stats = Slice(stats, r, plan.repeats);
      buffers.dq = MutableSlice(*dq, r, plan.repeats);
      buffers.dk = MutableSlice(*dk, r, plan.repeats);
      buffers.dv = MutableSlice(*dv, r, plan.repeats);
      if (dbias) buffers.dbias = MutableSlice(*dbias, r, plan.repeats);
      buffers.fp8 = Fp8Slice(plan, amaxes, r);
      JAX_SDPA_RETURN_IF_ERROR(
          call.graph->ExecuteBackward(call.handle.get(), buffers, call.workspace));
    }
    if (plan.optional.tails) {
      JAX_SDPA_RETURN_IF_ERROR(ZeroTokenTails(stream, device, *plan.optional.tails, 0, *dq));
      JAX_SDPA_RETURN_IF_ERROR(ZeroTokenTails(stream, device, *plan.optional.tails, 1, *dk));
      JAX_SDPA_RETURN_IF_ERROR(ZeroTokenTails(stream, device, *plan.optional.tails, 1, *dv));
    }
    if (plan.optional.poison_rows) {
      for (ffi::AnyBuffer gradient : {*dq, *dk, *dv}) {
        JAX_SDPA_RETURN_IF_ERROR(
            PoisonFirstTokens(stream, device, *plan.optional.poison_rows, gradient));
      }
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_sdpa backward: ") + e.what());
  }
}

}  // namespace

// Every call's context and fixed inputs; the backward adds o, stats and d_o.
auto AttentionBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::ScratchAllocator>()
      .Ctx<ffi::State<CallState>>()
      .Arg<ffi::AnyBuffer>()   // q
      .Arg<ffi::AnyBuffer>()   // k
      .Arg<ffi::AnyBuffer>();  // v
}

auto ForwardBinding() {
  return AttentionBinding()
      .RemainingArgs()  // [bias], [q/kv lengths], [q/kv segment ids], [offsets], [page_table],
                        // [seed], [poison_rows], [tails], [fp8 scales]
      .Ret<ffi::AnyBuffer>()  // o
      .Ret<ffi::AnyBuffer>()  // stats
      .RemainingRets()        // [fp8 amaxes], [workspace]
      .Attrs<CallAttributes>();
}

auto BackwardBinding() {
  return AttentionBinding()
      .Arg<ffi::AnyBuffer>()  // o
      .Arg<ffi::AnyBuffer>()  // stats
      .Arg<ffi::AnyBuffer>()  // d_o
      .RemainingArgs()  // [bias], [q/kv lengths], [q/kv segment ids], [offsets], [page_table],
                        // [seed], [poison_rows], [tails], [fp8 scales]
      .Ret<ffi::AnyBuffer>()  // dq
      .Ret<ffi::AnyBuffer>()  // dk
      .Ret<ffi::AnyBuffer>()  // dv
      .RemainingRets()        // [dbias], [fp8 amaxes], [workspace]
      .Attrs<CallAttributes>();
}

// XLA calls this once per custom call when it loads an executable; the state lives as long as
// the executable (call_state.h).
ffi::ErrorOr<std::unique_ptr<CallState>> InstantiateCallState() {
  return std::make_unique<CallState>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CallStateInstantiateHandler, InstantiateCallState,
                              ffi::Ffi::BindInstantiate());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaForwardHandler, SdpaForward, ForwardBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaBackwardHandler, SdpaBackward, BackwardBinding());
// The same handlers, which XLA may record into its command buffers (CUDA graphs).
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaForwardCommandBufferHandler, SdpaForward, ForwardBinding(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdpaBackwardCommandBufferHandler, SdpaBackward, BackwardBinding(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_sdpa

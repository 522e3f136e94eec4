#include "call/execution.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "call/row_fills.h"
#include "common/cudnn_handles.h"
#include "graph/fp8_scales.h"
#include "graph/graph_cache.h"
#include "graph/sdpa_graphs.h"

namespace jax_sdpa {
namespace {

ffi::Error ZeroFill(cudaStream_t stream, bool zero, ffi::AnyBuffer buffer) {
  if (zero) {
    JAX_SDPA_CUDA_CHECK(cudaMemsetAsync(buffer.untyped_data(), 0, buffer.size_bytes(), stream));
  }
  return ffi::Error::Success();
}

// Whether an output that the tails do not cover (stats, dbias) is zero-filled first.
bool ZeroFirst(const CallPlan& plan) { return plan.zero_outputs || plan.zero_tails; }

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
// planning the call (workspace_planning.h), which XLA reuses like any temporary and orders like
// any buffer, in a command buffer too. Without one (no GPU while planning, or a graph needing
// more than planned), per-call scratch; but a call recorded into a command buffer replays
// after it returns, so it takes its own workspace for the executable's life (call_state.h).
ffi::ErrorOr<PreparedCall> PrepareCall(const CallContext& context, const SdpaConfig& config,
                                       const std::optional<ffi::AnyBuffer>& given_workspace) {
  JAX_SDPA_ASSIGN_OR_RETURN(BorrowedCudnnHandle handle,
                            BorrowedCudnnHandle::Borrow(config.device, context.stream));
  PreparedCall prepared{std::move(handle), nullptr, nullptr};
  GraphCache& cache = GraphCache::Global();
  cache.SweepIfPending(config.device, context.stream);
  prepared.graph = context.state.Find(config);
  if (prepared.graph) {
    cache.CountHit();
  } else {
    JAX_SDPA_ASSIGN_OR_RETURN(prepared.graph, cache.GetOrBuild(config, prepared.handle.get()));
    context.state.Remember(prepared.graph);
  }
  int64_t needed = prepared.graph->workspace_size();
  if (needed == 0) return prepared;
  if (given_workspace && static_cast<int64_t>(given_workspace->size_bytes()) >= needed) {
    prepared.workspace = given_workspace->untyped_data();
  } else if (context.command_buffer) {
    JAX_SDPA_RETURN_IF_ERROR(context.state.OwnWorkspace(*prepared.graph, &prepared.workspace));
  } else {
    JAX_SDPA_ASSIGN_OR_RETURN(prepared.workspace,
                              AllocateWorkspace(context.scratch, *prepared.graph));
  }
  return prepared;
}

// A ragged call whose grid the device chose: its numbers copied to the host, which waits for
// the stream, then the plan's config made that grid's (or its fallback's, ApplyGrid). Such a
// call cannot be recorded into a command buffer, where nothing may wait.
ffi::Error ReadGrid(const CallContext& context, CallPlan& plan) {
  if (!plan.operands.grid) return ffi::Error::Success();
  if (context.command_buffer) {
    return ffi::Error::InvalidArgument("jax_sdpa: a device grid cannot be recorded");
  }
  const Operand& operand = *plan.operands.grid;
  std::vector<int32_t> grid(operand.element_count());
  JAX_SDPA_CUDA_CHECK(cudaMemcpyAsync(grid.data(), operand.untyped_data(), operand.size_bytes(),
                                      cudaMemcpyDeviceToHost, context.stream));
  JAX_SDPA_CUDA_CHECK(cudaStreamSynchronize(context.stream));
  return ApplyGrid(grid, plan);
}

// XLA's dtype of each ElementType, in its order.
ffi::DataType BufferType(ElementType type) {
  static constexpr ffi::DataType kTypes[] = {ffi::DataType::F16, ffi::DataType::BF16,
                                             ffi::DataType::F8E4M3FN, ffi::DataType::F8E5M2};
  return kTypes[static_cast<int32_t>(type)];
}

// An FP8 call's amaxes: float32 [..., count, kFp8ScaleRow].
ffi::Error CheckAmaxes(const CallPlan& plan, const CallResults& results) {
  if (!IsFp8(plan.config.element_type)) return ffi::Error::Success();
  Direction direction = plan.config.direction;
  int64_t expected = plan.repeats * Fp8AmaxCount(direction) * kFp8ScaleRow;
  if (!results.amaxes || results.amaxes->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(results.amaxes->element_count()) != expected) {
    return InvalidArgument("FP8 amaxes must be float32 [" +
                           std::to_string(Fp8AmaxCount(direction)) + ", " +
                           std::to_string(kFp8ScaleRow) + "] per call");
  }
  return ffi::Error::Success();
}

// Pointer to the r-th of `repeats` equal slices of a buffer.
const void* Slice(const Operand& buffer, int64_t r, int64_t repeats) {
  return static_cast<const char*>(buffer.untyped_data()) + r * (buffer.size_bytes() / repeats);
}
void* MutableSlice(ffi::AnyBuffer buffer, int64_t r, int64_t repeats) {
  return static_cast<char*>(buffer.untyped_data()) + r * (buffer.size_bytes() / repeats);
}
const void* OptionalSlice(const std::optional<Operand>& buffer, int64_t r, int64_t repeats) {
  return buffer ? Slice(*buffer, r, repeats) : nullptr;
}

AttentionInputs InputsSlice(const CallPlan& plan, int64_t r) {
  const CallOperands& in = plan.operands;
  int64_t repeats = plan.repeats;
  AttentionInputs slice;
  slice.q = Slice(*in.query, r, repeats);
  slice.k = Slice(*in.key, r, repeats);
  slice.v = Slice(*in.value, r, repeats);
  slice.bias = OptionalSlice(in.bias, r, repeats);
  slice.q_lengths = OptionalSlice(in.q_lengths, r, repeats);
  slice.kv_lengths = OptionalSlice(in.kv_lengths, r, repeats);
  slice.q_segment_ids = OptionalSlice(in.q_segment_ids, r, repeats);
  slice.kv_segment_ids = OptionalSlice(in.kv_segment_ids, r, repeats);
  if (in.offsets) {
    const int32_t* rows = static_cast<const int32_t*>(Slice(*in.offsets, r, repeats));
    slice.offsets = {rows, rows + plan.offsets_row, rows + 2 * plan.offsets_row,
                     rows + 3 * plan.offsets_row, rows + 4 * plan.offsets_row};
  }
  if (in.page_table) slice.page_table = in.page_table->untyped_data();
  slice.dropout_seed = OptionalSlice(in.dropout_seed, r, repeats);
  slice.score_mod_tables = OptionalSlice(in.score_mod_tables, r, repeats);
  return slice;
}

Fp8Buffers Fp8Slice(const CallPlan& plan, const CallResults& results, int64_t r) {
  if (!IsFp8(plan.config.element_type)) return {};
  return {static_cast<const float*>(Slice(*plan.operands.scales, r, plan.repeats)),
          static_cast<float*>(MutableSlice(*results.amaxes, r, plan.repeats))};
}

// Rows the plan poisons (their first token NaN: a broken stated bound), after cuDNN ran.
ffi::Error PoisonRows(const CallContext& context, const CallPlan& plan, ffi::AnyBuffer buffer) {
  if (!plan.operands.poison_rows) return ffi::Error::Success();
  return PoisonFirstTokens(context.stream, context.device, *plan.operands.poison_rows, buffer);
}

// Tokens past each row's lengths (side 0: the queries', 1: the keys') made zeros after cuDNN
// ran, where the plan zeroes tails.
ffi::Error ZeroTails(const CallContext& context, const CallPlan& plan, int side,
                     ffi::AnyBuffer buffer) {
  if (!plan.zero_tails) return ffi::Error::Success();
  return ZeroTokenTails(context.stream, context.device, *plan.operands.tails, side, buffer);
}

}  // namespace

ffi::Error RunForward(const CallContext& context, CallPlan& plan, const CallResults& results) {
  JAX_SDPA_RETURN_IF_ERROR(ReadGrid(context, plan));
  const SdpaConfig& c = plan.config;
  const Operand& q = *plan.operands.query;
  ffi::AnyBuffer o = *results.output;
  ffi::AnyBuffer stats = *results.stats;
  JAX_SDPA_RETURN_IF_ERROR(CheckShape(o, q.element_type(), OutputDims(q, c), "output"));
  JAX_SDPA_RETURN_IF_ERROR(CheckShape(stats, ffi::DataType::F32, StatsDims(q, c), "stats"));
  JAX_SDPA_RETURN_IF_ERROR(CheckAmaxes(plan, results));
  JAX_SDPA_RETURN_IF_ERROR(ZeroFill(context.stream, plan.zero_outputs, o));
  JAX_SDPA_RETURN_IF_ERROR(ZeroFill(context.stream, ZeroFirst(plan), stats));
  JAX_SDPA_ASSIGN_OR_RETURN(PreparedCall call, PrepareCall(context, c, results.workspace));
  for (int64_t r = 0; r < plan.repeats; ++r) {
    ForwardBuffers buffers;
    buffers.in = InputsSlice(plan, r);
    buffers.o = MutableSlice(o, r, plan.repeats);
    buffers.stats = MutableSlice(stats, r, plan.repeats);
    buffers.fp8 = Fp8Slice(plan, results, r);
    JAX_SDPA_RETURN_IF_ERROR(
        call.graph->ExecuteForward(call.handle.get(), buffers, call.workspace));
  }
  JAX_SDPA_RETURN_IF_ERROR(ZeroTails(context, plan, 0, o));
  return PoisonRows(context, plan, o);
}

ffi::Error RunBackward(const CallContext& context, CallPlan& plan, const CallResults& results) {
  JAX_SDPA_RETURN_IF_ERROR(ReadGrid(context, plan));
  const SdpaConfig& c = plan.config;
  const CallOperands& in = plan.operands;
  const Operand& q = *in.query;
  JAX_SDPA_RETURN_IF_ERROR(CheckShape(*in.output, q.element_type(), OutputDims(q, c), "output"));
  ffi::DataType gradient_type = BufferType(c.gradient_type);
  JAX_SDPA_RETURN_IF_ERROR(
      CheckShape(*in.d_output, gradient_type, OutputDims(q, c), "output cotangent"));
  JAX_SDPA_RETURN_IF_ERROR(CheckShape(*in.stats, ffi::DataType::F32, StatsDims(q, c), "stats"));
  ffi::AnyBuffer dq = *results.dq, dk = *results.dk, dv = *results.dv;
  JAX_SDPA_RETURN_IF_ERROR(CheckShape(dq, gradient_type, ToVector(q.dimensions()),
                                      "query gradient"));
  JAX_SDPA_RETURN_IF_ERROR(CheckShape(dk, gradient_type, ToVector(in.key->dimensions()),
                                      "key gradient"));
  JAX_SDPA_RETURN_IF_ERROR(CheckShape(dv, gradient_type, ToVector(in.value->dimensions()),
                                      "value gradient"));
  if (c.bias_grad) {
    if (!results.dbias) return InvalidArgument("a bias gradient needs its result");
    JAX_SDPA_RETURN_IF_ERROR(CheckShape(*results.dbias, in.bias->element_type(),
                                        ToVector(in.bias->dimensions()), "bias gradient"));
    JAX_SDPA_RETURN_IF_ERROR(ZeroFill(context.stream, ZeroFirst(plan), *results.dbias));
  }
  JAX_SDPA_RETURN_IF_ERROR(CheckAmaxes(plan, results));
  for (ffi::AnyBuffer gradient : {dq, dk, dv}) {
    JAX_SDPA_RETURN_IF_ERROR(ZeroFill(context.stream, plan.zero_outputs, gradient));
  }
  JAX_SDPA_ASSIGN_OR_RETURN(PreparedCall call, PrepareCall(context, c, results.workspace));
  for (int64_t r = 0; r < plan.repeats; ++r) {
    BackwardBuffers buffers;
    buffers.in = InputsSlice(plan, r);
    buffers.o = Slice(*in.output, r, plan.repeats);
    buffers.d_o = Slice(*in.d_output, r, plan.repeats);
    buffers.stats = Slice(*in.stats, r, plan.repeats);
    buffers.dq = MutableSlice(dq, r, plan.repeats);
    buffers.dk = MutableSlice(dk, r, plan.repeats);
    buffers.dv = MutableSlice(dv, r, plan.repeats);
    if (c.bias_grad) buffers.dbias = MutableSlice(*results.dbias, r, plan.repeats);
    buffers.fp8 = Fp8Slice(plan, results, r);
    JAX_SDPA_RETURN_IF_ERROR(
        call.graph->ExecuteBackward(call.handle.get(), buffers, call.workspace));
  }
  JAX_SDPA_RETURN_IF_ERROR(ZeroTails(context, plan, 0, dq));
  JAX_SDPA_RETURN_IF_ERROR(ZeroTails(context, plan, 1, dk));
  JAX_SDPA_RETURN_IF_ERROR(ZeroTails(context, plan, 1, dv));
  for (ffi::AnyBuffer gradient : {dq, dk, dv}) {
    JAX_SDPA_RETURN_IF_ERROR(PoisonRows(context, plan, gradient));
  }
  return ffi::Error::Success();
}

}  // namespace jax_sdpa

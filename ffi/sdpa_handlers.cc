#include "sdpa_handlers.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <exception>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "call_state.h"
#include "check.h"
#include "cudnn_handles.h"
#include "graph_cache.h"
#include "poison_rows.h"
#include "sdpa_config.h"
#include "sdpa_graphs.h"

// The attributes both handlers take, declared once: the struct's fields, its decoding and the
// names Python is checked against (HandlerAttributeNames) all come from this list.
#define JAX_SDPA_ATTRIBUTES(X, SEP)                                                  \
  X(float, scale)                                                                    \
  SEP X(float, soft_cap)       /* cap * tanh(scores / cap); 0: none */                \
  SEP X(int64_t, window_left)  /* cuDNN's exclusive left bound; -1: none */          \
  SEP X(int64_t, window_right) /* 0 is causal; -1: none */                           \
  SEP X(bool, bottom_right)                                                          \
  SEP X(bool, has_bias)                                                              \
  SEP X(bool, has_lengths)                                                           \
  SEP X(bool, ragged) /* packed documents: lengths per document, offsets */          \
  SEP X(int64_t, max_document_q)  /* ragged: the longest document's queries; 0: T */  \
  SEP X(int64_t, max_document_kv) /* and keys; 0: S */                                \
  SEP X(bool, paged) /* forward: K/V page pools and a page table */                  \
  SEP X(bool, bias_grad)                                                             \
  SEP X(bool, deterministic)                                                         \
  SEP X(float, dropout)                                                              \
  SEP X(bool, zero_outputs) /* elements no document or length covers stay zero */    \
  SEP X(bool, poison_rows)  /* int32 [rows] operand: rows whose first token becomes NaN */ \
  SEP X(int64_t, debug)     /* DebugFlags */                                         \
  SEP X(bool, command_buffer) /* recorded into command buffers: see PrepareCall */     \
  SEP X(bool, workspace_result) /* the last result is the call's cuDNN workspace */

#define JAX_SDPA_FIELD(type, name) type name;
#define JAX_SDPA_DECODE(type, name) ::xla::ffi::StructMember<type>(#name)
#define JAX_SDPA_NAME(type, name) #name
#define JAX_SDPA_NOTHING
#define JAX_SDPA_COMMA ,

namespace jax_sdpa {
namespace {

struct Options {
  JAX_SDPA_ATTRIBUTES(JAX_SDPA_FIELD, JAX_SDPA_NOTHING)
};

// Bits of the `debug` attribute (tests only).
enum DebugFlags : int64_t {
  // NaN-fill outputs before cuDNN runs, to prove every element is written, and the workspace,
  // to prove cuDNN initialises what it reads there.
  kPoisonOutputs = 1,
};

std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

std::string DimsToString(const std::vector<int64_t>& dims) {
  return DimsToString(ffi::Span<const int64_t>(dims.data(), dims.size()));
}

// The buffer has exactly this dtype and these dims, or an error naming it.
ffi::Error CheckShape(const ffi::AnyBuffer& buffer, ffi::DataType type,
                      const std::vector<int64_t>& expected, const char* name) {
  auto dims = buffer.dimensions();
  bool same = buffer.element_type() == type && dims.size() == expected.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = dims[i] == expected[i];
  if (!same) {
    return InvalidArgument(std::string(name) + " must be " + DimsToString(expected) + " of " +
                           "the expected dtype, got " + DimsToString(dims));
  }
  return ffi::Error::Success();
}

std::vector<int64_t> ToVector(ffi::Span<const int64_t> dims) {
  return std::vector<int64_t>(dims.begin(), dims.end());
}

ffi::ErrorOr<ElementType> ReadElementType(const ffi::AnyBuffer& buffer, const char* name) {
  switch (buffer.element_type()) {
    case ffi::DataType::F16:
      return ElementType::kFloat16;
    case ffi::DataType::BF16:
      return ElementType::kBFloat16;
    default:
      return Failure{InvalidArgument(std::string(name) + " must be float16 or bfloat16")};
  }
}

// The optional inputs after the fixed ones: [bias], [q_lengths, kv_lengths], [offsets],
// [page_table], [dropout_seed], [poison_rows].
struct OptionalInputs {
  std::optional<ffi::AnyBuffer> bias, q_lengths, kv_lengths, offsets, page_table, dropout_seed,
      poison_rows;
};

// How one call maps onto a cached graph: the config, and how many times the graph runs, each
// time on the next 1/repeats of every operand.
struct CallPlan {
  SdpaConfig config;
  int64_t repeats = 1;
  int64_t offsets_row = 0;  // ragged: elements per row of the offsets operand
  OptionalInputs optional;
};

// Reads the optional operands from `count` buffers, `get(i)` returning the i-th (an
// ffi::ErrorOr<ffi::AnyBuffer>): from XLA's remaining arguments, or from shapes Python describes
// when it plans a call (PlannedWorkspaceBytes).
template <typename Get>
ffi::ErrorOr<OptionalInputs> ReadOptionalInputs(size_t count, Get get, const Options& options) {
  bool has_dropout = options.dropout > 0;
  size_t expected = (options.has_bias ? 1 : 0) + (options.has_lengths ? 2 : 0) +
                    (options.ragged ? 1 : 0) + (options.paged ? 1 : 0) + (has_dropout ? 1 : 0) +
                    (options.poison_rows ? 1 : 0);
  if (count != expected) {
    return Failure{InvalidArgument("expected " + std::to_string(expected) +
                                   " optional operands, got " + std::to_string(count))};
  }
  OptionalInputs inputs;
  size_t index = 0;
  auto next = [&](std::optional<ffi::AnyBuffer>* slot) -> ffi::Error {
    ffi::ErrorOr<ffi::AnyBuffer> buffer = get(index++);
    if (!buffer.has_value()) return buffer.error();
    *slot = *buffer;
    return ffi::Error::Success();
  };
  if (options.has_bias) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.bias));
  if (options.has_lengths) {
    JAX_SDPA_RETURN_IF_ERROR(next(&inputs.q_lengths));
    JAX_SDPA_RETURN_IF_ERROR(next(&inputs.kv_lengths));
  }
  if (options.ragged) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.offsets));
  if (options.paged) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.page_table));
  if (has_dropout) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.dropout_seed));
  if (options.poison_rows) JAX_SDPA_RETURN_IF_ERROR(next(&inputs.poison_rows));
  return inputs;
}

ffi::ErrorOr<OptionalInputs> ReadOptionalInputs(const ffi::RemainingArgs& rest,
                                                const Options& options) {
  return ReadOptionalInputs(
      rest.size(), [&](size_t i) { return rest.get<ffi::AnyBuffer>(i); }, options);
}

int64_t QueryTokens(const SdpaConfig& c) {
  return c.ragged ? c.total_q_tokens : c.batch * c.q_seq_len;
}

// Reads the operands into a graph config; every shape is checked here, before cuDNN sees it.
ffi::ErrorOr<CallPlan> PlanCall(Direction direction, int32_t device, const ffi::AnyBuffer& q,
                                const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                OptionalInputs optional_inputs, const Options& options) {
  CallPlan plan;
  plan.optional = std::move(optional_inputs);
  const OptionalInputs& optional = plan.optional;
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  size_t rank = qd.size();
  if (rank < 4 || kd.size() != rank || vd.size() != rank) {
    return Failure{InvalidArgument("query, key and value must share one rank >= 4, got " +
                                   DimsToString(qd) + ", " + DimsToString(kd) + ", " +
                                   DimsToString(vd))};
  }
  int64_t vmapped = 1;  // product of the leading (vmap) axes
  for (size_t i = 0; i + 4 < rank; ++i) {
    if (qd[i] != kd[i]) return Failure{InvalidArgument("query and key leading axes differ")};
    vmapped *= qd[i];
  }
  int64_t batch = qd[rank - 4];
  SdpaConfig& c = plan.config;
  c.direction = direction;
  c.device = device;
  JAX_SDPA_ASSIGN_OR_RETURN(c.element_type, ReadElementType(q, "query"));
  JAX_SDPA_ASSIGN_OR_RETURN(ElementType k_type, ReadElementType(k, "key"));
  JAX_SDPA_ASSIGN_OR_RETURN(ElementType v_type, ReadElementType(v, "value"));
  bool same_kv = true;  // key and value agree on every axis but head_dim
  for (size_t i = 0; i + 1 < rank; ++i) same_kv &= kd[i] == vd[i];
  if (k_type != c.element_type || v_type != c.element_type || !same_kv ||
      kd[rank - 4] != batch || kd[rank - 1] != qd[rank - 1] || kd[rank - 2] == 0 ||
      qd[rank - 2] % kd[rank - 2] != 0) {
    return Failure{InvalidArgument("query " + DimsToString(qd) + ", key " + DimsToString(kd) +
                                   " and value " + DimsToString(vd) +
                                   " do not form one attention problem")};
  }
  c.q_seq_len = qd[rank - 3];
  c.kv_seq_len = kd[rank - 3];
  c.q_heads = qd[rank - 2];
  c.kv_heads = kd[rank - 2];
  c.head_dim = qd[rank - 1];
  c.head_dim_v = vd[rank - 1];
  c.scale = options.scale;
  c.soft_cap = options.soft_cap;
  c.window_left = options.window_left;
  c.window_right = options.window_right;
  c.bottom_right = options.bottom_right;
  c.deterministic = direction == Direction::kBackward && options.deterministic;
  c.padding = options.has_lengths;
  c.ragged = options.ragged;
  c.dropout = options.dropout;
  if (c.ragged && !c.padding) {
    return Failure{InvalidArgument("the ragged layout needs per-document lengths")};
  }
  // Lengths are int32 [batch], or [documents] in the ragged layout, per vmapped slice.
  int64_t entries = batch;
  if (c.padding) {
    int64_t count = static_cast<int64_t>(optional.q_lengths->element_count());
    if (c.ragged) entries = count / vmapped;
    for (const ffi::AnyBuffer* lengths : {&*optional.q_lengths, &*optional.kv_lengths}) {
      if (lengths->element_type() != ffi::DataType::S32 ||
          static_cast<int64_t>(lengths->element_count()) != vmapped * entries || entries == 0) {
        return Failure{InvalidArgument(std::string("sequence lengths must be int32 [") +
                                       (c.ragged ? "documents" : "batch") + "], got " +
                                       DimsToString(lengths->dimensions()))};
      }
    }
  }
  if (c.ragged) {
    const ffi::AnyBuffer& offsets = *optional.offsets;
    int64_t count = static_cast<int64_t>(offsets.element_count());
    plan.offsets_row = count / (5 * vmapped);
    if (offsets.element_type() != ffi::DataType::S32 || count != 5 * vmapped * plan.offsets_row ||
        plan.offsets_row < entries + 1) {
      return Failure{InvalidArgument("ragged offsets must be int32 [5, >= documents + 1], got " +
                                     DimsToString(offsets.dimensions()) + " for " +
                                     std::to_string(entries) + " documents")};
    }
  }
  if (c.dropout > 0) {
    const ffi::AnyBuffer& seed = *optional.dropout_seed;
    if (seed.element_type() != ffi::DataType::U32 ||
        static_cast<int64_t>(seed.element_count()) != vmapped * 4) {
      return Failure{InvalidArgument("the dropout seed must be uint32 [4], got " +
                                     DimsToString(seed.dimensions()))};
    }
  }
  // The graph runs once per vmapped slice when a slice's operands cannot be folded into one
  // batch: a bias shared by the slice's batch (no single batch stride says that), a dropout
  // seed per slice, or documents whose offsets count from their slice's start.
  bool shared_bias = optional.bias && optional.bias->dimensions()[rank - 4] == 1 && batch > 1;
  bool per_slice = vmapped > 1 && (shared_bias || c.dropout > 0 || c.ragged);
  plan.repeats = per_slice ? vmapped : 1;
  int64_t folded_batch = per_slice ? batch : vmapped * batch;
  if (c.ragged) {
    c.batch = entries;
    c.total_q_tokens = folded_batch * c.q_seq_len;
    c.total_kv_tokens = folded_batch * c.kv_seq_len;
    // A bound on the documents' lengths below the rows' sizes the kernels' grid to the
    // documents rather than to the rows (Python guarantees every document fits).
    if (options.max_document_q > c.q_seq_len || options.max_document_kv > c.kv_seq_len ||
        options.max_document_q < 0 || options.max_document_kv < 0) {
      return Failure{InvalidArgument("document length bounds " +
                                     std::to_string(options.max_document_q) + ", " +
                                     std::to_string(options.max_document_kv) +
                                     " exceed the rows' lengths")};
    }
    if (options.max_document_q > 0) c.q_seq_len = options.max_document_q;
    if (options.max_document_kv > 0) c.kv_seq_len = options.max_document_kv;
  } else {
    c.batch = folded_batch;
  }
  if (optional.bias) {
    if (c.ragged) return Failure{InvalidArgument("a bias cannot go with the ragged layout")};
    auto bd = optional.bias->dimensions();
    JAX_SDPA_ASSIGN_OR_RETURN(ElementType bias_type, ReadElementType(*optional.bias, "bias"));
    int64_t bias_vmapped = 1;
    for (size_t i = 0; bd.size() == rank && i + 4 < rank; ++i) bias_vmapped *= bd[i];
    if (bd.size() != rank || bias_type != c.element_type || bias_vmapped != vmapped ||
        (bd[rank - 4] != 1 && bd[rank - 4] != batch) ||
        (bd[rank - 3] != 1 && bd[rank - 3] != c.q_heads) || bd[rank - 2] != c.q_seq_len ||
        bd[rank - 1] != c.kv_seq_len) {
      return Failure{InvalidArgument("bias " + DimsToString(bd) +
                                     " must be [1|batch, 1|heads, q_seq, kv_seq] in the inputs' "
                                     "dtype, for query " + DimsToString(qd))};
    }
    c.bias_heads = bd[rank - 3];
    c.bias_batch = per_slice ? bd[rank - 4] : bd[rank - 4] * vmapped;
    c.bias_grad = direction == Direction::kBackward && options.bias_grad;
  }
  return plan;
}

// A paged forward: q [B, T, N, H]; key and value page pools [pages, page_size, K, H|Hv];
// int32 [B] lengths (queries, keys) and page table [B, pages per sequence]. No bias, dropout,
// ragged layout or vmapped axes (Python sends none).
ffi::ErrorOr<CallPlan> PlanPagedCall(int32_t device, const ffi::AnyBuffer& q,
                                     const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                     OptionalInputs optional, const Options& options) {
  CallPlan plan;
  plan.optional = std::move(optional);
  if (!options.has_lengths || options.ragged || options.has_bias || options.dropout > 0) {
    return Failure{InvalidArgument("a paged call takes lengths and a page table, and no bias, "
                                   "dropout or ragged layout")};
  }
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  const ffi::AnyBuffer& table = *plan.optional.page_table;
  auto td = table.dimensions();
  SdpaConfig& c = plan.config;
  c.direction = Direction::kForward;
  c.device = device;
  JAX_SDPA_ASSIGN_OR_RETURN(c.element_type, ReadElementType(q, "query"));
  JAX_SDPA_ASSIGN_OR_RETURN(ElementType k_type, ReadElementType(k, "key cache"));
  JAX_SDPA_ASSIGN_OR_RETURN(ElementType v_type, ReadElementType(v, "value cache"));
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 ||
      k_type != c.element_type || v_type != c.element_type || kd[0] != vd[0] ||
      kd[1] != vd[1] || kd[2] != vd[2] || kd[3] != qd[3] || kd[2] == 0 || qd[2] % kd[2] != 0 ||
      td[0] != qd[0] || table.element_type() != ffi::DataType::S32) {
    return Failure{InvalidArgument("query " + DimsToString(qd) + ", key cache " +
                                   DimsToString(kd) + ", value cache " + DimsToString(vd) +
                                   " and page table " + DimsToString(td) +
                                   " do not form one paged attention problem")};
  }
  c.batch = qd[0];
  c.q_seq_len = qd[1];
  c.q_heads = qd[2];
  c.head_dim = qd[3];
  c.num_pages = kd[0];
  c.page_size = kd[1];
  c.kv_heads = kd[2];
  c.head_dim_v = vd[3];
  c.kv_seq_len = td[1] * c.page_size;
  for (const ffi::AnyBuffer* lengths : {&*plan.optional.q_lengths, &*plan.optional.kv_lengths}) {
    if (lengths->element_type() != ffi::DataType::S32 ||
        static_cast<int64_t>(lengths->element_count()) != c.batch) {
      return Failure{InvalidArgument("sequence lengths must be int32 [batch], got " +
                                     DimsToString(lengths->dimensions()))};
    }
  }
  c.scale = options.scale;
  c.soft_cap = options.soft_cap;
  c.window_left = options.window_left;
  c.window_right = options.window_right;
  c.bottom_right = options.bottom_right;
  c.padding = true;
  return plan;
}

// The output (and its cotangent): the query's shape with the value's head_dim.
std::vector<int64_t> OutputDims(const ffi::AnyBuffer& q, const SdpaConfig& c) {
  std::vector<int64_t> dims = ToVector(q.dimensions());
  dims.back() = c.head_dim_v;
  return dims;
}

// Stats: [..., batch, q_heads, q_seq], or token-major [..., batch, q_seq, q_heads] (ragged).
std::vector<int64_t> StatsDims(const ffi::AnyBuffer& q, const SdpaConfig& c) {
  std::vector<int64_t> dims = ToVector(q.dimensions());
  size_t rank = dims.size();
  int64_t seq = dims[rank - 3], heads = dims[rank - 2];
  dims.pop_back();
  dims[rank - 3] = c.ragged ? seq : heads;
  dims[rank - 2] = c.ragged ? heads : seq;
  return dims;
}

// Fills an output before cuDNN runs: zeros where elements may be left unwritten by cuDNN
// (padding, tokens of no document), or all-ones bytes (NaN in every float type) when a test
// asks to prove every element is written.
ffi::Error Prefill(cudaStream_t stream, const Options& options, ffi::AnyBuffer buffer) {
  if (options.zero_outputs) {
    JAX_SDPA_CUDA_CHECK(cudaMemsetAsync(buffer.untyped_data(), 0, buffer.size_bytes(), stream));
  } else if (options.debug & kPoisonOutputs) {
    JAX_SDPA_CUDA_CHECK(
        cudaMemsetAsync(buffer.untyped_data(), 0xFF, buffer.size_bytes(), stream));
  }
  return ffi::Error::Success();
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
                                       const Options& options,
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
  } else if (options.command_buffer) {
    JAX_SDPA_RETURN_IF_ERROR(state.OwnWorkspace(*prepared.graph, &prepared.workspace));
  } else {
    JAX_SDPA_ASSIGN_OR_RETURN(prepared.workspace, AllocateWorkspace(scratch, *prepared.graph));
  }
  if (options.debug & kPoisonOutputs) {  // the answer must not depend on what it held before
    JAX_SDPA_CUDA_CHECK(
        cudaMemsetAsync(prepared.workspace, 0xFF, static_cast<size_t>(needed), stream));
  }
  return prepared;
}

// The call's plan from its operands: a paged forward or any other.
ffi::ErrorOr<CallPlan> PlanAnyCall(Direction direction, int32_t device, const ffi::AnyBuffer& q,
                                   const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                   OptionalInputs optional, const Options& options) {
  if (options.paged) {
    if (direction == Direction::kBackward) {
      return Failure{InvalidArgument("paged attention has no backward")};
    }
    return PlanPagedCall(device, q, k, v, std::move(optional), options);
  }
  return PlanCall(direction, device, q, k, v, std::move(optional), options);
}

// The workspace XLA allocated as the call's result `index` among the remaining ones, if the
// call has one.
ffi::ErrorOr<std::optional<ffi::AnyBuffer>> GivenWorkspace(ffi::RemainingRets& extra,
                                                           size_t index,
                                                           const Options& options) {
  if (!options.workspace_result) return std::optional<ffi::AnyBuffer>();
  auto result = extra.get<ffi::AnyBuffer>(index);
  if (!result.has_value()) return Failure{result.error()};
  return std::optional<ffi::AnyBuffer>(**result);
}

// Pointer to the r-th of `repeats` equal slices of a buffer.
const void* Slice(const ffi::AnyBuffer& buffer, int64_t r, int64_t repeats) {
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
  if (optional.offsets) {
    const int32_t* rows = static_cast<const int32_t*>(Slice(*optional.offsets, r, repeats));
    in.offsets = {rows, rows + plan.offsets_row, rows + 2 * plan.offsets_row,
                  rows + 3 * plan.offsets_row, rows + 4 * plan.offsets_row};
  }
  if (optional.page_table) in.page_table = optional.page_table->untyped_data();
  if (optional.dropout_seed) in.dropout_seed = Slice(*optional.dropout_seed, r, repeats);
  return in;
}

ffi::Error SdpaForward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                       CallState* state, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> o,
                       ffi::Result<ffi::AnyBuffer> stats, ffi::RemainingRets extra_results,
                       Options options) {
  try {
    JAX_SDPA_ASSIGN_OR_RETURN(OptionalInputs optional, ReadOptionalInputs(rest, options));
    JAX_SDPA_ASSIGN_OR_RETURN(CallPlan plan, PlanAnyCall(Direction::kForward, device, q, k, v,
                                                         std::move(optional), options));
    const SdpaConfig& c = plan.config;
    JAX_SDPA_RETURN_IF_ERROR(CheckShape(*o, q.element_type(), OutputDims(q, c), "output"));
    JAX_SDPA_RETURN_IF_ERROR(CheckShape(*stats, ffi::DataType::F32, StatsDims(q, c), "stats"));
    JAX_SDPA_RETURN_IF_ERROR(Prefill(stream, options, *o));
    JAX_SDPA_RETURN_IF_ERROR(Prefill(stream, options, *stats));
    JAX_SDPA_ASSIGN_OR_RETURN(std::optional<ffi::AnyBuffer> workspace,
                              GivenWorkspace(extra_results, 0, options));
    JAX_SDPA_ASSIGN_OR_RETURN(PreparedCall call,
                              PrepareCall(stream, scratch, *state, c, options, workspace));
    for (int64_t r = 0; r < plan.repeats; ++r) {
      ForwardBuffers buffers;
      buffers.in = InputsSlice(q, k, v, plan, r);
      buffers.o = MutableSlice(*o, r, plan.repeats);
      buffers.stats = MutableSlice(*stats, r, plan.repeats);
      JAX_SDPA_RETURN_IF_ERROR(
          call.graph->ExecuteForward(call.handle.get(), buffers, call.workspace));
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
                        ffi::RemainingRets extra_results, Options options) {
  try {
    JAX_SDPA_ASSIGN_OR_RETURN(OptionalInputs optional, ReadOptionalInputs(rest, options));
    JAX_SDPA_ASSIGN_OR_RETURN(CallPlan plan, PlanAnyCall(Direction::kBackward, device, q, k, v,
                                                         std::move(optional), options));
    const SdpaConfig& c = plan.config;
    JAX_SDPA_RETURN_IF_ERROR(CheckShape(o, q.element_type(), OutputDims(q, c), "output"));
    JAX_SDPA_RETURN_IF_ERROR(
        CheckShape(d_o, q.element_type(), OutputDims(q, c), "output cotangent"));
    JAX_SDPA_RETURN_IF_ERROR(CheckShape(stats, ffi::DataType::F32, StatsDims(q, c), "stats"));
    JAX_SDPA_RETURN_IF_ERROR(
        CheckShape(*dq, q.element_type(), ToVector(q.dimensions()), "query gradient"));
    JAX_SDPA_RETURN_IF_ERROR(
        CheckShape(*dk, k.element_type(), ToVector(k.dimensions()), "key gradient"));
    JAX_SDPA_RETURN_IF_ERROR(
        CheckShape(*dv, v.element_type(), ToVector(v.dimensions()), "value gradient"));
    std::optional<ffi::AnyBuffer> dbias;
    if (c.bias_grad) {
      auto result = extra_results.get<ffi::AnyBuffer>(0);
      if (!result.has_value()) return result.error();
      dbias = **result;
      const ffi::AnyBuffer& bias = *plan.optional.bias;
      JAX_SDPA_RETURN_IF_ERROR(CheckShape(*dbias, bias.element_type(),
                                          ToVector(bias.dimensions()), "bias gradient"));
      JAX_SDPA_RETURN_IF_ERROR(Prefill(stream, options, *dbias));
    }
    for (ffi::AnyBuffer out : {*dq, *dk, *dv}) {
      JAX_SDPA_RETURN_IF_ERROR(Prefill(stream, options, out));
    }
    JAX_SDPA_ASSIGN_OR_RETURN(std::optional<ffi::AnyBuffer> workspace,
                              GivenWorkspace(extra_results, dbias ? 1 : 0, options));
    JAX_SDPA_ASSIGN_OR_RETURN(PreparedCall call,
                              PrepareCall(stream, scratch, *state, c, options, workspace));
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
      JAX_SDPA_RETURN_IF_ERROR(
          call.graph->ExecuteBackward(call.handle.get(), buffers, call.workspace));
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
}  // namespace jax_sdpa

// Attributes decode into one struct, by name.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_sdpa::Options,
                                      JAX_SDPA_ATTRIBUTES(JAX_SDPA_DECODE, JAX_SDPA_COMMA));

namespace jax_sdpa {

std::vector<std::string> HandlerAttributeNames() {
  return {JAX_SDPA_ATTRIBUTES(JAX_SDPA_NAME, JAX_SDPA_COMMA)};
}

namespace {

// Options from Python's attribute values by name (each held exactly by a double: bools, small
// integers, float32 values); every attribute must be there.
ffi::ErrorOr<Options> OptionsFromValues(const std::map<std::string, double>& values) {
  Options options;
#define JAX_SDPA_FROM_VALUE(type, name)                                              \
  {                                                                                  \
    auto found = values.find(#name);                                                 \
    if (found == values.end()) {                                                     \
      return Failure{InvalidArgument("the attribute " #name " is missing")};         \
    }                                                                                \
    options.name = static_cast<type>(found->second);                                 \
  }
  JAX_SDPA_ATTRIBUTES(JAX_SDPA_FROM_VALUE, JAX_SDPA_NOTHING)
#undef JAX_SDPA_FROM_VALUE
  return options;
}

ffi::ErrorOr<ffi::DataType> DataTypeNamed(const std::string& name) {
  static const std::map<std::string, ffi::DataType> kTypes = {
      {"float16", ffi::DataType::F16}, {"bfloat16", ffi::DataType::BF16},
      {"float32", ffi::DataType::F32}, {"int32", ffi::DataType::S32},
      {"uint32", ffi::DataType::U32},
  };
  auto found = kTypes.find(name);
  if (found == kTypes.end()) return Failure{InvalidArgument("no operand is of dtype " + name)};
  return found->second;
}

}  // namespace

ffi::ErrorOr<int64_t> PlannedWorkspaceBytes(bool backward, int32_t device,
                                            const std::vector<OperandShape>& operands,
                                            const std::map<std::string, double>& attributes) {
  try {
    JAX_SDPA_ASSIGN_OR_RETURN(Options options, OptionsFromValues(attributes));
    size_t fixed = backward ? 6 : 3;  // q, k, v (and o, stats, d_o)
    if (operands.size() < fixed) {
      return Failure{InvalidArgument("expected at least " + std::to_string(fixed) +
                                     " operands, got " + std::to_string(operands.size()))};
    }
    // Buffers without data: planning reads only dtypes and dims.
    std::vector<XLA_FFI_Buffer> described(operands.size());
    for (size_t i = 0; i < operands.size(); ++i) {
      JAX_SDPA_ASSIGN_OR_RETURN(ffi::DataType type, DataTypeNamed(operands[i].dtype));
      described[i] = XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr,
                                    static_cast<XLA_FFI_DataType>(type), nullptr,
                                    static_cast<int64_t>(operands[i].dims.size()),
                                    const_cast<int64_t*>(operands[i].dims.data())};
    }
    auto buffer = [&](size_t i) { return ffi::AnyBuffer(&described[i]); };
    JAX_SDPA_ASSIGN_OR_RETURN(
        OptionalInputs optional,
        ReadOptionalInputs(
            operands.size() - fixed,
            [&](size_t i) -> ffi::ErrorOr<ffi::AnyBuffer> { return buffer(fixed + i); },
            options));
    Direction direction = backward ? Direction::kBackward : Direction::kForward;
    JAX_SDPA_ASSIGN_OR_RETURN(CallPlan plan,
                              PlanAnyCall(direction, device, buffer(0), buffer(1), buffer(2),
                                          std::move(optional), options));
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
      .RemainingArgs()  // [bias], [q/kv lengths], [offsets], [page_table], [seed], [poison_rows]
      .Ret<ffi::AnyBuffer>()  // o
      .Ret<ffi::AnyBuffer>()  // stats
      .RemainingRets()        // [workspace]
      .Attrs<Options>();
}

auto BackwardBinding() {
  return AttentionBinding()
      .Arg<ffi::AnyBuffer>()  // o
      .Arg<ffi::AnyBuffer>()  // stats
      .Arg<ffi::AnyBuffer>()  // d_o
      .RemainingArgs()  // [bias], [q/kv lengths], [offsets], [page_table], [seed], [poison_rows]
      .Ret<ffi::AnyBuffer>()  // dq
      .Ret<ffi::AnyBuffer>()  // dk
      .Ret<ffi::AnyBuffer>()  // dv
      .RemainingRets()        // [dbias], [workspace]
      .Attrs<Options>();
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

// The cuDNN frontend graph of one SdpaConfig, described but not yet validated or built
// (graph_description.cc). The product's SdpaGraph (sdpa_graphs.cc) builds it with the
// heuristics' first plan; the plan-timing tools (devtools/) build every plan. Including this
// pulls in the frontend header, which takes ~40 s to compile: only those translation units
// include it.
#pragma once

#include <cudnn_frontend.h>

#include <cstdint>
#include <memory>

#include "graph/sdpa_config.h"

namespace jax_sdpa {

// How a variant pack names the device buffers of one execution.
enum TensorUid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kBias,
  kDBias,
  kQLengths,
  kKvLengths,
  kDropoutSeed,
  kDropoutOffset,
  kQOffsets,  // ragged layout: element offsets of each document in Q (and dQ)
  kKOffsets,
  kVOffsets,
  kOOffsets,  // O and dO
  kStatsOffsets,
  kKPageTable,  // paged K/V: int32 [batch, pages per sequence]; one table serves K and V
  kVPageTable,
  kFp8Scales,         // an FP8 call's scale factors: kFp8Scales + Fp8Scale (fp8_scales.h)
  kQSegmentIds = 48,  // segment_mask: int32 [batch, q_seq] ids of the queries
  kKvSegmentIds,      // and [batch, kv_seq] of the keys
  kFp8Amaxes = 64,    // and its amaxes: kFp8Amaxes + Fp8ForwardAmax / Fp8BackwardAmax
  kScoreModTables = 96,  // a score modifier's tables: kScoreModTables + i, i < kMaxScoreModTables
};

// The forward or backward graph (config.direction) of `config`.
std::shared_ptr<cudnn_frontend::graph::Graph> DescribeSdpaGraph(
    const SdpaConfig& config, ForwardImplementation implementation = ForwardImplementation::kAuto);

}  // namespace jax_sdpa

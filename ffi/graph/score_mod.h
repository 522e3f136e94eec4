// A score modifier's pointwise program (jax_sdpa/score_mod/program.py writes them: the user's
// score_mod and its derivative) as cuDNN pointwise nodes on the scores of an SDPA graph.
#pragma once

#include <cudnn_frontend.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "graph/sdpa_config.h"

namespace jax_sdpa {

using ScoreTensor = std::shared_ptr<cudnn_frontend::graph::Tensor_attributes>;

// What a program reads: the score (s), the incoming gradient (g, a derivative's only) and
// its tables (t0, t1, ...: [1, q_heads, 1, 1] each).
struct ScoreModInputs {
  ScoreTensor score;
  ScoreTensor gradient;
  std::vector<ScoreTensor> tables;
};

// The program's result as nodes of `graph`; std::invalid_argument on a malformed program.
ScoreTensor ApplyScoreMod(const std::shared_ptr<cudnn_frontend::graph::Graph>& graph,
                          const std::string& program, const ScoreModInputs& inputs);

// Which of the config's score_mod_tables its graph reads (the forward's program; a backward's
// derivative too): a graph holds those only, since cuDNN refuses inputs no node reads.
std::vector<bool> ScoreModTablesRead(const SdpaConfig& c);

// The tables' tensors: float32 [batch, count, q_heads] in memory, table i at uid first_uid + i
// viewed as [1, q_heads, 1, 1] (the first batch row, broadcast: cuDNN's kernels read a
// modifier's tensor wrongly when it varies by batch, so the rows must be equal; Python refuses
// tables that vary by batch); null where `read` says the graph does not read it.
std::vector<ScoreTensor> AddScoreModTables(cudnn_frontend::graph::Graph& graph, int64_t q_heads,
                                           const std::vector<bool>& read, int64_t first_uid);

}  // namespace jax_sdpa

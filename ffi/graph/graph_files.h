// Built cuDNN graphs kept on disk across processes, in a directory the user opts into
// (JAX_SDPA_GRAPH_CACHE_DIR, as JAX's compilation cache directory): the first call of a config
// in a new process loads its graph instead of building it. Each file holds one serialized graph
// under a key naming everything it depends on (the config, cuDNN's and the frontend's
// versions, the GPU), with a checksum. A missing, stale, foreign, truncated or corrupt file is
// never an error: it reads as absent and the graph is built (and written) again.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace jax_sdpa {

class GraphFiles {
 public:
  explicit GraphFiles(std::string directory) : directory_(std::move(directory)) {}

  // The directory named by JAX_SDPA_GRAPH_CACHE_DIR, or nullptr when it is unset or empty.
  static const GraphFiles* FromEnvironment();

  // The payload written under `key`, or nullopt when there is no usable file for it.
  std::optional<std::vector<uint8_t>> Read(const std::string& key) const;

  // Writes the payload under `key`: to a temporary file renamed into place, so that a reader
  // (another process) never sees half a file. Creates the directory. False on any failure.
  bool Write(const std::string& key, const std::vector<uint8_t>& payload) const;

  // Whether a file is stored where `key` would be (usable or not).
  bool Exists(const std::string& key) const;

  // The file a key is stored in (its name is a hash of the key; the key itself is inside).
  std::string PathOf(const std::string& key) const;

 private:
  std::string directory_;
};

}  // namespace jax_sdpa

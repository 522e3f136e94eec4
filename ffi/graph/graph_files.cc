#include "graph/graph_files.h"

#include <unistd.h>

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>

namespace jax_sdpa {
namespace {

// File layout: the magic line, then the key's length and the payload's length (decimal, one
// line each), the payload's checksum (hex line), the key, the payload. Bump the magic's version
// when the layout or the meaning of a key's field changes: older files then read as foreign.
constexpr char kMagic[] = "jax_sdpa cudnn graph v2\n";

uint64_t Fnv1a(const uint8_t* data, size_t size) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < size; ++i) hash = (hash ^ data[i]) * 0x100000001b3ULL;
  return hash;
}

std::string Hex(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

bool MakeDirectories(const std::string& path) {
  std::string partial;
  std::stringstream parts(path);
  std::string part;
  if (!path.empty() && path[0] == '/') partial = "/";
  while (std::getline(parts, part, '/')) {
    if (part.empty()) continue;
    partial += part + "/";
    if (mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) return false;
  }
  struct stat info;
  return stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

}  // namespace

const GraphFiles* GraphFiles::FromEnvironment() {
  static const GraphFiles* files = []() -> const GraphFiles* {
    const char* directory = std::getenv("JAX_SDPA_GRAPH_CACHE_DIR");
    if (directory == nullptr || *directory == '\0') return nullptr;
    return new GraphFiles(directory);  // never destroyed, like the graph cache
  }();
  return files;
}

std::string GraphFiles::PathOf(const std::string& key) const {
  const auto* bytes = reinterpret_cast<const uint8_t*>(key.data());
  return directory_ + "/" + Hex(Fnv1a(bytes, key.size())) + ".cudnn-graph";
}

bool GraphFiles::Exists(const std::string& key) const {
  struct stat info;
  return stat(PathOf(key).c_str(), &info) == 0;
}

std::optional<std::vector<uint8_t>> GraphFiles::Read(const std::string& key) const {
  std::ifstream file(PathOf(key), std::ios::binary);
  if (!file) return std::nullopt;
  std::string magic(sizeof(kMagic) - 1, '\0');
  if (!file.read(&magic[0], static_cast<std::streamsize>(magic.size())) || magic != kMagic) {
    return std::nullopt;
  }
  std::string key_size_line, payload_size_line, checksum_line;
  if (!std::getline(file, key_size_line) || !std::getline(file, payload_size_line) ||
      !std::getline(file, checksum_line)) {
    return std::nullopt;
  }
  char* end = nullptr;
  unsigned long long key_size = std::strtoull(key_size_line.c_str(), &end, 10);
  if (end == key_size_line.c_str() || *end != '\0' || key_size != key.size()) return std::nullopt;
  unsigned long long payload_size = std::strtoull(payload_size_line.c_str(), &end, 10);
  if (end == payload_size_line.c_str() || *end != '\0' || payload_size > (1ULL << 32)) {
    return std::nullopt;
  }
  std::string stored_key(key.size(), '\0');
  if (!file.read(&stored_key[0], static_cast<std::streamsize>(stored_key.size())) ||
      stored_key != key) {
    return std::nullopt;  // another config whose name hashes alike, or a foreign file
  }
  std::vector<uint8_t> payload(payload_size);
  if (!file.read(reinterpret_cast<char*>(payload.data()),
                 static_cast<std::streamsize>(payload.size()))) {
    return std::nullopt;  // truncated
  }
  if (file.peek() != std::char_traits<char>::eof()) return std::nullopt;  // trailing bytes
  if (checksum_line != Hex(Fnv1a(payload.data(), payload.size()))) return std::nullopt;
  return payload;
}

bool GraphFiles::Write(const std::string& key, const std::vector<uint8_t>& payload) const {
  if (!MakeDirectories(directory_)) return false;
  std::string path = PathOf(key);
  // Unique per process and thread: two writers of one key each rename a whole file.
  std::ostringstream temporary;
  temporary << path << ".tmp." << getpid() << "." << std::hash<std::string>{}(key) << "."
            << reinterpret_cast<uintptr_t>(&temporary);
  {
    std::ofstream file(temporary.str(), std::ios::binary | std::ios::trunc);
    if (!file) return false;
    file << kMagic << key.size() << "\n" << payload.size() << "\n"
         << Hex(Fnv1a(payload.data(), payload.size())) << "\n" << key;
    file.write(reinterpret_cast<const char*>(payload.data()),
               static_cast<std::streamsize>(payload.size()));
    if (!file.flush()) {
      std::remove(temporary.str().c_str());
      return false;
    }
  }
  if (std::rename(temporary.str().c_str(), path.c_str()) != 0) {
    std::remove(temporary.str().c_str());
    return false;
  }
  return true;
}

}  // namespace jax_sdpa

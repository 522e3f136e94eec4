// The attributes of our FFI calls (attribute_list.h) as one struct: the handlers' decoding
// (sdpa_handlers.cc), the names Python is checked against (HandlerAttributeNames) and the
// trace-time decoding from Python's values (AttributesFromValues) all come from the lists.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "attribute_list.h"
#include "check.h"

#define JAX_SDPA_DECODE(type, name, default_value) ::xla::ffi::StructMember<type>(#name)
#define JAX_SDPA_NAME(type, name, default_value) #name

namespace jax_sdpa {

struct CallAttributes {
  JAX_SDPA_ATTRIBUTES(JAX_SDPA_FIELD, JAX_SDPA_NOTHING)
};

// The attribute names, in order: what Python must send (tests compare).
std::vector<std::string> HandlerAttributeNames();

// The attributes from Python's values by name (each held exactly by a double: bools, small
// integers, float32 values); every attribute must be there.
ffi::ErrorOr<CallAttributes> AttributesFromValues(const std::map<std::string, double>& values);

}  // namespace jax_sdpa

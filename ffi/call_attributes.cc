#include "call_attributes.h"

namespace jax_sdpa {

std::vector<std::string> HandlerAttributeNames() {
  return {JAX_SDPA_ATTRIBUTES(JAX_SDPA_NAME, JAX_SDPA_COMMA)};
}

ffi::ErrorOr<CallAttributes> AttributesFromValues(const std::map<std::string, double>& values) {
  CallAttributes attributes;
#define JAX_SDPA_FROM_VALUE(type, name, default_value)                        \
  {                                                                          \
    auto found = values.find(#name);                                         \
    if (found == values.end()) {                                             \
      return Failure{InvalidArgument("the attribute " #name " is missing")}; \
    }                                                                        \
    attributes.name = static_cast<type>(found->second);                      \
  }
  JAX_SDPA_ATTRIBUTES(JAX_SDPA_FROM_VALUE, JAX_SDPA_NOTHING)
#undef JAX_SDPA_FROM_VALUE
  return attributes;
}


}  // namespace jax_sdpa

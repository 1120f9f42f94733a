// Counter-based hashing for seeded, machine-independent randomness (dropout masks, random
// weight init, the CLI's word embedding): the same seed gives the same numbers everywhere,
// whatever the thread count or batch composition.
#ifndef ATTENTION_CORE_HASH_H_
#define ATTENTION_CORE_HASH_H_

#include <cstdint>

#include "core/host_device.h"

namespace attention::core {

// The splitmix64 finaliser: a bijective mix of 64 bits.
ATTENTION_HOST_DEVICE inline uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// Uniform in [0, 1) from the top 53 bits of a mixed value.
ATTENTION_HOST_DEVICE inline double UnitInterval(uint64_t mixed) { return static_cast<double>(mixed >> 11) * 0x1.0p-53; }

}  // namespace attention::core

#endif  // ATTENTION_CORE_HASH_H_

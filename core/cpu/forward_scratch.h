// Working memory of the CPU backend's forward passes, kept per calling thread and reused:
// allocating and zero-filling tens of MB per batch (page faults on fresh memory) cost about
// a fifth of a BERT-sized batch. It grows to the largest batch the thread has run and is
// freed with the thread. Every buffer is fully written before it is read, so nothing is
// zeroed.
#ifndef ATTENTION_CORE_CPU_FORWARD_SCRATCH_H_
#define ATTENTION_CORE_CPU_FORWARD_SCRATCH_H_

#include <cstddef>
#include <cstdint>
#include <memory>

namespace attention::core {

class ForwardScratch {
 public:
  // kRounded: a bf16 layer's attended rows, rounded for the output projection.
  enum Slot { kX, kKeyInput, kValueInput, kQ, kK, kV, kAttended, kRounded, kProjected, kSlots };

  // `count` elements of T (float, or uint16_t for bf16) in `slot`.
  template <typename T = float>
  T* Get(Slot slot, int64_t count) {
    const auto bytes = static_cast<int64_t>(count * sizeof(T));
    if (sizes_[slot] < bytes) {
      // 64-byte aligned, as the packed weights, for whole-line vector loads.
      buffers_[slot].reset(new (std::align_val_t{64}) std::byte[bytes]);
      sizes_[slot] = bytes;
    }
    return reinterpret_cast<T*>(buffers_[slot].get());
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<std::byte[], Free> buffers_[kSlots];
  int64_t sizes_[kSlots] = {};
};

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_FORWARD_SCRATCH_H_

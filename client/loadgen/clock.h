// Clock helpers of attention-loadgen: the steady clock its schedule and latencies use, and
// conversions from seconds.
#ifndef ATTENTION_CLIENT_LOADGEN_CLOCK_H_
#define ATTENTION_CLIENT_LOADGEN_CLOCK_H_

#include <chrono>

namespace attention::loadgen {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;

inline TimePoint After(TimePoint t, double seconds) {
  return t + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// gRPC deadlines take the system clock.
inline std::chrono::system_clock::time_point SystemDeadline(double seconds_from_now) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             std::chrono::duration<double>(seconds_from_now));
}

}  // namespace attention::loadgen

#endif  // ATTENTION_CLIENT_LOADGEN_CLOCK_H_

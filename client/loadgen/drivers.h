// attention-loadgen's load drivers: the closed loop (callers with one request in flight
// each) and the open loop (Poisson arrivals), over the shared state of one run.
#ifndef ATTENTION_CLIENT_LOADGEN_DRIVERS_H_
#define ATTENTION_CLIENT_LOADGEN_DRIVERS_H_

#include <atomic>
#include <cstdint>
#include <functional>

#include "client/loadgen/clock.h"
#include "client/loadgen/config.h"
#include "client/loadgen/recorder.h"
#include "client/loadgen/requests.h"
#include "client/loadgen/transports.h"

namespace attention::loadgen {

// Shared state of one run: the window, the recorder and the flags that end it.
// Thread-safe.
class Run {
 public:
  Run(const Config& config, const RequestFactory& factory, Transport& transport, TimePoint start)
      : config_(config),
        factory_(factory),
        transport_(transport),
        start_(start),
        window_begin_(After(start, config.warmup)),
        end_(After(window_begin_, config.duration)),
        recorder_(window_begin_, end_) {}

  TimePoint start() const { return start_; }
  TimePoint end() const { return end_; }
  bool Stopped() const { return stopped_.load(std::memory_order_acquire); }
  InFlight& in_flight() { return in_flight_; }
  Recorder& recorder() { return recorder_; }

  // Issues one request of `tokens` tokens whose latency counts from `start`; `then` runs
  // after its outcome is recorded and before it stops counting as in flight (so a closed
  // loop caller can issue its next request without the count touching zero in between).
  // Returns false (and records "not sent") when it cannot be sent.
  bool Issue(int64_t lane, int64_t tokens, TimePoint start, std::function<void()> then);

  // After the load: waits for outstanding answers until the drain deadline, cancels the
  // rest, closes the transport and waits for it.
  void Drain();

 private:
  const Config& config_;
  const RequestFactory& factory_;
  Transport& transport_;
  const TimePoint start_, window_begin_, end_;
  InFlight in_flight_;
  Recorder recorder_;
  std::atomic<bool> stopped_{false};
  std::atomic<bool> drain_cancelled_{false};
};

// Closed loop: --concurrency callers, each sending its next request from the answer's
// callback, until the end of the window; then drains the run.
void RunClosedLoop(const Config& config, Run& run, const RequestFactory& factory);

// Open loop: this thread sleeps until each scheduled arrival and sends it; then drains the
// run.
void RunOpenLoop(const Config& config, Run& run, const RequestFactory& factory);

}  // namespace attention::loadgen

#endif  // ATTENTION_CLIENT_LOADGEN_DRIVERS_H_

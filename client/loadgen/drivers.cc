// attention-loadgen's load drivers.
#include "client/loadgen/drivers.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <thread>
#include <utility>
#include <vector>

namespace attention::loadgen {
namespace {

// Generator of closed-loop caller `index`: seeded with (seed, index).
std::mt19937_64 CallerRng(uint64_t seed, int index) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(index)};
  return std::mt19937_64(seq);
}

// Closed loop: one caller with one request in flight; the next one goes out from the
// answer's callback. Its generator is only touched by the one call chain, in sequence.
class Caller {
 public:
  Caller(Run& run, const RequestFactory& factory, int index, uint64_t seed)
      : run_(run), factory_(factory), index_(index), rng_(CallerRng(seed, index)) {}

  void Next() {
    const TimePoint now = Clock::now();
    if (run_.Stopped() || now >= run_.end()) return;
    run_.Issue(index_, factory_.PickLength(rng_), now, [this] { Next(); });
  }

 private:
  Run& run_;
  const RequestFactory& factory_;
  const int index_;
  std::mt19937_64 rng_;
};

}  // namespace

bool Run::Issue(int64_t lane, int64_t tokens, TimePoint start, std::function<void()> then) {
  in_flight_.Begin();
  const int64_t query_tokens = factory_.QueryTokens(tokens);
  auto on_done = [this, start, query_tokens, then = std::move(then)](grpc::StatusCode code) {
    const TimePoint finish = Clock::now();
    if (code == grpc::StatusCode::OK) {
      recorder_.Ok(start, finish, query_tokens);
    } else if (drain_cancelled_.load(std::memory_order_acquire)) {
      recorder_.Unanswered(start);
    } else {
      recorder_.Error(start, code);
    }
    if (then) then();
    in_flight_.End();
  };
  const bool sent = transport_.Send(lane, factory_.Make(tokens), std::move(on_done));
  if (!sent) {
    if (drain_cancelled_.load(std::memory_order_acquire)) {
      recorder_.Unanswered(start);
    } else {
      recorder_.NotSent(start);
    }
    in_flight_.End();
  }
  return sent;
}

void Run::Drain() {
  const TimePoint deadline = After(std::max(Clock::now(), end_), config_.drain_timeout);
  if (!in_flight_.WaitZeroUntil(deadline)) {
    std::fprintf(stderr,
                 "attention-loadgen: %" PRId64
                 " requests still unanswered after --drain_timeout=%g s; cancelling them\n",
                 in_flight_.Count(), config_.drain_timeout);
    drain_cancelled_.store(true, std::memory_order_release);
    stopped_.store(true, std::memory_order_release);
    transport_.CancelAll();
    if (!in_flight_.WaitZeroUntil(After(Clock::now(), 60))) {
      std::fprintf(stderr, "attention-loadgen: cancelled requests did not finish\n");
      std::abort();
    }
  }
  transport_.CloseAndWait();
}

void RunClosedLoop(const Config& config, Run& run, const RequestFactory& factory) {
  std::vector<std::unique_ptr<Caller>> callers;
  for (int i = 0; i < config.concurrency; ++i) {
    callers.push_back(std::make_unique<Caller>(run, factory, i, config.seed));
  }
  for (auto& caller : callers) caller->Next();
  std::this_thread::sleep_until(run.end());  // the callers run on gRPC's threads
  run.Drain();
}

// Open loop: this thread sleeps until each scheduled arrival and sends it.
void RunOpenLoop(const Config& config, Run& run, const RequestFactory& factory) {
  std::mt19937_64 rng(config.seed);
  std::exponential_distribution<double> gap(config.rate);
  TimePoint scheduled = run.start();
  for (int64_t lane = 0;; ++lane) {
    scheduled = After(scheduled, gap(rng));
    if (scheduled >= run.end()) break;
    const int64_t tokens = factory.PickLength(rng);
    std::this_thread::sleep_until(scheduled);
    if (run.in_flight().Count() >= config.max_outstanding) {
      run.recorder().NotSent(scheduled);
      continue;
    }
    run.recorder().SendLag(scheduled, Clock::now());
    run.Issue(lane, tokens, scheduled, nullptr);
  }
  run.Drain();
}

}  // namespace attention::loadgen

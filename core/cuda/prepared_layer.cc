#include "core/cuda/prepared_layer.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <utility>

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "core/attention_kernels.h"
#include "core/cuda/copy_overlap_plan.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/device_backend.h"
#include "core/cuda/kernels.h"
#include "core/cuda/linear.h"
#include "core/cuda/staging.h"
#include "core/forward_plan.h"
#include "core/status_macros.h"

namespace attention::core::cuda {

CudaPreparedLayer::~CudaPreparedLayer() {
  if (memory_ != nullptr) {
    cudaSetDevice(backend_.device());
    cudaFree(memory_);
  }
}

absl::Status CudaPreparedLayer::Upload(const MhaWeightsView& w) {
  // One allocation for every tensor; Q, K and V stay fused when the host has them fused. A
  // BFLOAT16 layer's matrices go up as the bf16 the host holds.
  const bool fused = !w.fused_qkv_weight.empty() || !w.bf16.fused_qkv_weight.empty();
  struct Part {
    const void* host;
    int64_t bytes;
    const void** device;
    int64_t offset = 0;
  };
  std::vector<Part> parts;
  const auto add = [&parts](auto host, auto** device) {
    parts.push_back({host.data(), static_cast<int64_t>(host.size() * sizeof(host[0])),
                     reinterpret_cast<const void**>(device)});
  };
  add(w.out_weight, &weights_.out_weight);
  add(w.bf16.out_weight, &weights_.out_weight_bf16);
  add(w.out_bias, &weights_.out_bias);
  if (fused) {
    add(w.fused_qkv_weight, &weights_.fused_qkv_weight);
    add(w.bf16.fused_qkv_weight, &weights_.fused_qkv_weight_bf16);
    add(w.fused_qkv_bias, &weights_.fused_qkv_bias);
  } else {
    add(w.q_weight, &weights_.q_weight);
    add(w.k_weight, &weights_.k_weight);
    add(w.v_weight, &weights_.v_weight);
    add(w.bf16.q_weight, &weights_.q_weight_bf16);
    add(w.bf16.k_weight, &weights_.k_weight_bf16);
    add(w.bf16.v_weight, &weights_.v_weight_bf16);
    add(w.q_bias, &weights_.q_bias);
    add(w.k_bias, &weights_.k_bias);
    add(w.v_bias, &weights_.v_bias);
  }
  Arena arena;
  for (Part& part : parts) part.offset = arena.Add(part.bytes);
  bytes_ = arena.size();
  RETURN_IF_ERROR(CudaStatus(cudaMalloc(&memory_, std::max<int64_t>(bytes_, 1)),
                             absl::StrCat("cudaMalloc(", bytes_, " bytes of weights)")));
  char* base = static_cast<char*>(memory_);
  for (const Part& part : parts) {
    if (part.bytes == 0) continue;
    RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy(base + part.offset, part.host, part.bytes, cudaMemcpyHostToDevice),
                   "cudaMemcpy(weights)"));
    *part.device = base + part.offset;
  }
  if (fused) {
    // Q, K and V rows, and their biases, are ranges of the fused matrix (as on the host).
    const MhaConfig& c = config_;
    const int64_t k_offset = c.QWidth() * c.embed_dim,
                  v_offset = k_offset + c.KWidth() * c.embed_dim;
    if (weights_.fused_qkv_weight != nullptr) {
      weights_.q_weight = weights_.fused_qkv_weight;
      weights_.k_weight = weights_.q_weight + k_offset;
      weights_.v_weight = weights_.q_weight + v_offset;
    }
    if (weights_.fused_qkv_weight_bf16 != nullptr) {
      weights_.q_weight_bf16 = weights_.fused_qkv_weight_bf16;
      weights_.k_weight_bf16 = weights_.q_weight_bf16 + k_offset;
      weights_.v_weight_bf16 = weights_.q_weight_bf16 + v_offset;
    }
    if (weights_.fused_qkv_bias != nullptr) {
      weights_.q_bias = weights_.fused_qkv_bias;
      weights_.k_bias = weights_.q_bias + c.QWidth();
      weights_.v_bias = weights_.k_bias + c.KWidth();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaPreparedLayer::InFlight> CudaPreparedLayer::Enqueue(
    absl::Span<const MhaInput* const> inputs, StreamContext& lane) const {
  const MhaConfig& c = config_;
  const size_t count = inputs.size();
  const bool bf16 = c.compute_dtype == DType::kBFloat16;
  const ForwardPlan plan = PlanForward(
      c, inputs, weights_.fused_qkv_weight != nullptr || weights_.fused_qkv_weight_bf16 != nullptr);
  const int64_t q_rows = plan.q_rows, kv_rows = plan.kv_rows;
  const bool all_self_attention = plan.all_self_attention;

  // Memory: inputs (copied in at once), scratch, outputs (copied out at once). 16-bit
  // inputs are copied as sent and converted into the float32 token matrices on the device;
  // when no input brings float32 tokens through the staging, those matrices are scratch
  // and are not copied in at all. Inputs the device copies straight (from page-locked host
  // memory or its own) go into their rows (or their 16-bit area) once the staging is in.
  const auto copied_straight = [](const MhaInput& in) {
    return in.inputs_memory != InputMemory::kHost;
  };
  const bool tokens_from_host = std::any_of(inputs.begin(), inputs.end(), [&](const MhaInput* in) {
    return !in->is_half() && !copied_straight(*in);
  });
  Arena arena;
  auto plan_tokens = [&] {
    return std::array<int64_t, 3>{
        arena.Add(q_rows * c.embed_dim * sizeof(float)),
        all_self_attention ? -1 : arena.Add(kv_rows * c.kdim * sizeof(float)),
        all_self_attention ? -1 : arena.Add(kv_rows * c.vdim * sizeof(float))};
  };
  std::array<int64_t, 3> tokens_at = {-1, -1, -1};
  if (tokens_from_host) tokens_at = plan_tokens();
  // Per input: where its 16-bit query, key and value are (-1: none), staged from the host
  // or, for inputs copied straight, past the staged bytes.
  std::vector<std::array<int64_t, 3>> half_at(count, {-1, -1, -1});
  const auto plan_half = [&](bool straight) {
    for (size_t n = 0; n < count; ++n) {
      const MhaInput& in = *inputs[n];
      if (!in.is_half() || copied_straight(in) != straight) continue;
      half_at[n][0] = arena.Add(in.query_half.size() * sizeof(uint16_t));
      if (!in.key_half.empty()) {
        half_at[n][1] = arena.Add(in.key_half.size() * sizeof(uint16_t));
        half_at[n][2] = arena.Add(in.value_half.size() * sizeof(uint16_t));
      }
    }
  };
  plan_half(/*straight=*/false);
  // Input n's 16-bit query, key and value, each with where it goes.
  const auto half_tensors = [&](size_t n) {
    const MhaInput& in = *inputs[n];
    return std::array<std::pair<int64_t, absl::Span<const uint16_t>>, 3>{
        {{half_at[n][0], in.query_half},
         {half_at[n][1], in.key_half},
         {half_at[n][2], in.value_half}}};
  };
  std::vector<StagedMask> masks(count);
  for (size_t n = 0; n < count; ++n) masks[n].Plan(inputs[n]->options, arena);
  Staged staged;
  staged.input_bytes = arena.size();
  if (!tokens_from_host) tokens_at = plan_tokens();
  plan_half(/*straight=*/true);
  const int64_t x_at = tokens_at[0], xk_at = tokens_at[1], xv_at = tokens_at[2];
  // Projected Q, K and V: one [q_rows, Q + K + V] matrix when fused.
  const int64_t q_at = arena.Add(q_rows * plan.q_stride * sizeof(float));
  const int64_t k_at = plan.fused_qkv ? -1 : arena.Add(kv_rows * c.KWidth() * sizeof(float));
  const int64_t v_at = plan.fused_qkv ? -1 : arena.Add(kv_rows * c.VWidth() * sizeof(float));
  const int64_t attended_at =
      c.output_projection ? arena.Add(q_rows * c.AttentionWidth() * sizeof(float)) : -1;
  // A BFLOAT16 layer's GEMM inputs rounded to bf16, one matrix at a time (the stream runs
  // each rounding after the GEMM before it).
  const int64_t rounded_at =
      bf16 ? arena.Add(std::max({q_rows * c.embed_dim, kv_rows * c.kdim, kv_rows * c.vdim,
                                 q_rows * c.AttentionWidth()}) *
                       sizeof(uint16_t))
           : -1;
  std::vector<StagedWeights> weights(count);
  for (size_t n = 0; n < count; ++n) {
    weights[n].PlanScratch(plan.inputs[n].dims, inputs[n]->options.need_weights, arena);
  }
  // Callers who want bf16 answers (a bf16 request over the wire) get them rounded on the
  // device: half the bytes come back. The float32 output is then scratch.
  const bool bf16_answers = std::all_of(inputs.begin(), inputs.end(), [](const MhaInput* in) {
    return !in->output_destination_bf16.empty();
  });
  const int64_t float_output_bytes = q_rows * c.output_dim * sizeof(float);
  const int64_t float_output_scratch_at = bf16_answers ? arena.Add(float_output_bytes) : -1;
  staged.output_offset = arena.Add(0);
  const int64_t answers_at =
      arena.Add(bf16_answers ? q_rows * c.output_dim * sizeof(uint16_t) : float_output_bytes);
  const int64_t output_at = bf16_answers ? float_output_scratch_at : answers_at;
  const int64_t answers_end_at = arena.Add(0);
  for (size_t n = 0; n < count; ++n) {
    weights[n].PlanOutput(plan.inputs[n].dims, inputs[n]->options.need_weights, arena);
  }
  staged.output_bytes = arena.size() - staged.output_offset;
  // Answers written into GPU memory need no copy back; attention weights still come back.
  const bool all_answers_on_gpu = std::all_of(inputs.begin(), inputs.end(),
                                              [](const MhaInput* in) { return in->output_on_gpu; });
  const int64_t copied_back_at = all_answers_on_gpu ? answers_end_at : staged.output_offset;

  StreamContext* context = &lane;
  ASSIGN_OR_RETURN(char* device, context->device.Reserve(arena.size()));
  ASSIGN_OR_RETURN(char* staging, context->staging.Reserve(arena.size()));
  auto host = [staging](int64_t at) { return reinterpret_cast<float*>(staging + at); };
  auto on_device = [device](int64_t at) { return reinterpret_cast<float*>(device + at); };
  ThreadPool& copiers = backend_.host_copies();
  const CopyFloats copy_floats = [&copiers](absl::Span<const float> from, float* to) {
    ParallelCopy(copiers, to, from.data(), from.size() * sizeof(float));
  };

  for (size_t n = 0; n < count; ++n) {
    const MhaInput& in = *inputs[n];
    if (copied_straight(in)) {
      // Copied by the device below.
    } else if (in.is_half()) {
      for (auto [at, bits] : half_tensors(n)) {
        if (at >= 0)
          ParallelCopy(copiers, staging + at, bits.data(), bits.size() * sizeof(uint16_t));
      }
    } else {
      PackInputTokens(c, plan.inputs[n], in, host(x_at), all_self_attention ? nullptr : host(xk_at),
                      all_self_attention ? nullptr : host(xv_at), copy_floats);
    }
    masks[n].Stage(in.options, staging);
  }
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(device, staging, staged.input_bytes, cudaMemcpyHostToDevice, context->stream),
      "cudaMemcpyAsync(inputs)"));
  // Inputs copied straight, after the staged bytes (which may cover their rows): from
  // page-locked host memory or the GPU's own (the driver tells them apart).
  absl::Status straight_copies;
  const auto copy_straight = [&](const void* from, void* to, size_t bytes) {
    if (!straight_copies.ok() || bytes == 0) return;
    straight_copies =
        CudaStatus(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, context->stream),
                   "cudaMemcpyAsync(inputs copied straight)");
  };
  for (size_t n = 0; n < count; ++n) {
    const MhaInput& in = *inputs[n];
    if (!copied_straight(in)) continue;
    if (in.is_half()) {
      for (auto [at, bits] : half_tensors(n)) {
        if (at >= 0) copy_straight(bits.data(), device + at, bits.size() * sizeof(uint16_t));
      }
    } else {
      PackInputTokens(c, plan.inputs[n], in, on_device(x_at),
                      all_self_attention ? nullptr : on_device(xk_at),
                      all_self_attention ? nullptr : on_device(xv_at),
                      [&](absl::Span<const float> from, float* to) {
                        copy_straight(from.data(), to, from.size() * sizeof(float));
                      });
    }
  }
  RETURN_IF_ERROR(straight_copies);
  for (size_t n = 0; n < count; ++n) {
    const MhaInput& in = *inputs[n];
    if (!in.is_half()) continue;
    const ForwardPlan::Input& planned = plan.inputs[n];
    const bool bfloat16 = in.half_dtype == DType::kBFloat16;
    auto convert = [&](int64_t at, size_t elements, float* out) {
      return CudaStatus(LaunchHalfToFloat(reinterpret_cast<const uint16_t*>(device + at), out,
                                          elements, bfloat16, context->stream),
                        "16-bit conversion kernel");
    };
    RETURN_IF_ERROR(convert(half_at[n][0], in.query_half.size(),
                            on_device(x_at) + planned.q_row * c.embed_dim));
    if (!all_self_attention) {
      // A self-attention input of a mixed batch: its key and value rows are its query rows.
      const bool self = in.key_half.empty();
      RETURN_IF_ERROR(convert(self ? half_at[n][0] : half_at[n][1],
                              self ? in.query_half.size() : in.key_half.size(),
                              on_device(xk_at) + planned.kv_row * c.kdim));
      RETURN_IF_ERROR(convert(self ? half_at[n][0] : half_at[n][2],
                              self ? in.query_half.size() : in.value_half.size(),
                              on_device(xv_at) + planned.kv_row * c.vdim));
    }
  }

  // y = x W^T + bias in the layer's precision.
  const auto linear = [&](const float* x, int64_t rows, int64_t in, const float* weight,
                          const uint16_t* weight_bf16, const float* bias, int64_t out, float* y,
                          int64_t ldy) -> absl::Status {
    auto* rounded = bf16 ? reinterpret_cast<uint16_t*>(device + rounded_at) : nullptr;
    RETURN_IF_ERROR(RoundForLayer(*context, x, rows * in, rounded));
    return LinearInPrecision(*context, x, rounded, rows, in, weight, weight_bf16, bias, out, y,
                             ldy);
  };
  // Projections over every token of the batch, at the plan's strides.
  float *q = on_device(q_at), *k, *v;
  if (plan.fused_qkv) {
    RETURN_IF_ERROR(linear(on_device(x_at), q_rows, c.embed_dim, weights_.fused_qkv_weight,
                           weights_.fused_qkv_weight_bf16, weights_.fused_qkv_bias, plan.q_stride,
                           q, plan.q_stride));
    k = q + c.QWidth();
    v = k + c.KWidth();
  } else {
    const float* key_input = all_self_attention ? on_device(x_at) : on_device(xk_at);
    const float* value_input = all_self_attention ? on_device(x_at) : on_device(xv_at);
    k = on_device(k_at);
    v = on_device(v_at);
    RETURN_IF_ERROR(linear(on_device(x_at), q_rows, c.embed_dim, weights_.q_weight,
                           weights_.q_weight_bf16, weights_.q_bias, c.QWidth(), q, plan.q_stride));
    RETURN_IF_ERROR(linear(key_input, kv_rows, c.kdim, weights_.k_weight, weights_.k_weight_bf16,
                           weights_.k_bias, c.KWidth(), k, plan.k_stride));
    RETURN_IF_ERROR(linear(value_input, kv_rows, c.vdim, weights_.v_weight, weights_.v_weight_bf16,
                           weights_.v_bias, c.VWidth(), v, plan.v_stride));
  }
  float* attended = c.output_projection ? on_device(attended_at) : on_device(output_at);
  for (size_t n = 0; n < count; ++n) {
    const ForwardPlan::Input& planned = plan.inputs[n];
    if (c.rope_theta > 0.0) {
      RETURN_IF_ERROR(
          CudaStatus(LaunchRotary(q + planned.q_row * plan.q_stride, planned.q_rows(),
                                  planned.dims.q_len, c.num_heads, c.head_dim, planned.rotary_base,
                                  c.rope_scaling, plan.q_stride, context->stream),
                     "rotary kernel"));
      RETURN_IF_ERROR(CudaStatus(
          LaunchRotary(k + planned.kv_row * plan.k_stride, planned.kv_rows(), planned.dims.kv_len,
                       c.num_kv_heads, c.head_dim, planned.rotary_base, c.rope_scaling,
                       plan.k_stride, context->stream),
          "rotary kernel"));
    }
    AttentionProblem problem = plan.Attention(n, q, k, v, attended);
    problem.bf16_products = bf16;
    RETURN_IF_ERROR(
        backend_.Attend(ToDeviceProblem(problem, masks[n], weights[n], device), *context));
  }
  if (c.output_projection) {
    RETURN_IF_ERROR(linear(attended, q_rows, c.AttentionWidth(), weights_.out_weight,
                           weights_.out_weight_bf16, weights_.out_bias, c.output_dim,
                           on_device(output_at), c.output_dim));
  }
  if (bf16_answers) {
    RETURN_IF_ERROR(
        CudaStatus(LaunchFloatToBFloat16(on_device(output_at),
                                         reinterpret_cast<uint16_t*>(device + answers_at),
                                         q_rows * c.output_dim, context->stream),
                   "bf16 answer rounding kernel"));
  }
  // Answers into GPU memory: float32 rows copied, bf16 rows rounded straight there.
  for (size_t n = 0; n < count; ++n) {
    const MhaInput& in = *inputs[n];
    if (!in.output_on_gpu) continue;
    const ForwardPlan::Input& planned = plan.inputs[n];
    const float* rows = on_device(output_at) + planned.q_row * c.output_dim;
    const int64_t elements = planned.q_rows() * c.output_dim;
    if (!in.output_destination_bf16.empty()) {
      RETURN_IF_ERROR(CudaStatus(
          LaunchFloatToBFloat16(rows, in.output_destination_bf16.data(), elements, context->stream),
          "bf16 answer rounding kernel"));
    } else {
      RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(in.output_destination.data(), rows, elements * sizeof(float),
                                     cudaMemcpyDeviceToDevice, context->stream),
                     "cudaMemcpyAsync(answer on the GPU)"));
    }
  }
  const int64_t copied_back_bytes = staged.output_offset + staged.output_bytes - copied_back_at;
  if (copied_back_bytes > 0) {
    RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(staging + copied_back_at, device + copied_back_at,
                                   copied_back_bytes, cudaMemcpyDeviceToHost, context->stream),
                   "cudaMemcpyAsync(outputs)"));
  }
  return InFlight{std::vector<const MhaInput*>(inputs.begin(), inputs.end()),
                  plan,
                  std::move(weights),
                  bf16_answers,
                  answers_at,
                  context,
                  staging};
}

absl::StatusOr<std::vector<AttentionResult>> CudaPreparedLayer::Deliver(
    const InFlight& flight) const {
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(flight.context->stream), "forward pass"));
  const MhaConfig& c = config_;
  ThreadPool& copiers = backend_.host_copies();
  const char* answers = flight.staging + flight.answers_at;
  std::vector<AttentionResult> results(flight.inputs.size());
  for (size_t n = 0; n < flight.inputs.size(); ++n) {
    const MhaInput& in = *flight.inputs[n];
    const ForwardPlan::Input& planned = flight.plan.inputs[n];
    const int64_t first = planned.q_row * c.output_dim, elements = planned.q_rows() * c.output_dim;
    if (in.output_on_gpu) {
      // Written on the device by Enqueue.
    } else if (flight.bf16_answers) {
      ParallelCopy(copiers, in.output_destination_bf16.data(), answers + first * sizeof(uint16_t),
                   elements * sizeof(uint16_t));
    } else if (!in.output_destination.empty()) {
      ParallelCopy(copiers, in.output_destination.data(), answers + first * sizeof(float),
                   elements * sizeof(float));
    } else {
      DeliverOutput(in, reinterpret_cast<const float*>(answers) + first, elements, &results[n]);
    }
    flight.weights[n].CopyOut(flight.staging, results[n].weights);
    FinishWeights(results[n], planned.dims, in.options.need_weights);
  }
  return results;
}

absl::StatusOr<std::vector<AttentionResult>> CudaPreparedLayer::ForwardBatch(
    absl::Span<const MhaInput* const> inputs) const {
  ASSIGN_OR_RETURN(StreamContext * first_lane, backend_.Context(0));
  const std::vector<size_t> chunks =
      CopyOverlapEnabled() ? PlanCopyOverlap(CopyOverlapPartBytes(inputs, config_.output_dim))
                           : std::vector<size_t>{0};
  if (chunks.size() == 1) {
    ASSIGN_OR_RETURN(InFlight flight, Enqueue(inputs, *first_lane));
    return Deliver(flight);
  }
  // Chunks alternate between two streams: chunk i + 1's inputs are packed and copied in
  // while chunk i computes; chunk i's answers come back while chunk i + 1 computes.
  ASSIGN_OR_RETURN(StreamContext * second_lane, backend_.Context(1));
  const std::array<StreamContext*, 2> lanes = {first_lane, second_lane};
  std::vector<AttentionResult> results;
  const BatchParts split = SplitBatch(inputs, config_.output_dim, results);
  std::vector<std::optional<InFlight>> flights(chunks.size());
  const absl::Status status = RunOverlappedChunks(
      chunks.size(),
      [&](size_t chunk, int lane) -> absl::Status {
        const size_t end = chunk + 1 < chunks.size() ? chunks[chunk + 1] : split.parts.size();
        ASSIGN_OR_RETURN(
            flights[chunk],
            Enqueue(absl::MakeConstSpan(split.parts).subspan(chunks[chunk], end - chunks[chunk]),
                    *lanes[lane]));
        return absl::OkStatus();
      },
      [&](size_t chunk) -> absl::Status {
        ASSIGN_OR_RETURN(std::vector<AttentionResult> answers, Deliver(*flights[chunk]));
        flights[chunk].reset();
        for (size_t i = 0; i < answers.size(); ++i) {
          const int64_t n = split.whole_input[chunks[chunk] + i];
          if (n >= 0) results[n] = std::move(answers[i]);
        }
        return absl::OkStatus();
      });
  if (!status.ok()) {
    // Nothing of this call may still run once it returns.
    for (StreamContext* lane : lanes) cudaStreamSynchronize(lane->stream);
    return status;
  }
  return results;
}

absl::Status CudaPreparedLayer::RoundForLayer(const StreamContext& context, const float* x,
                                              int64_t count, uint16_t* rounded) const {
  if (config_.compute_dtype != DType::kBFloat16) return absl::OkStatus();
  return CudaStatus(LaunchFloatToBFloat16(x, rounded, count, context.stream),
                    "bf16 rounding kernel");
}

absl::Status CudaPreparedLayer::LinearInPrecision(StreamContext& context, const float* x,
                                                  const uint16_t* x_bf16, int64_t rows, int64_t in,
                                                  const float* weight, const uint16_t* weight_bf16,
                                                  const float* bias, int64_t out, float* y,
                                                  int64_t ldy) const {
  if (config_.compute_dtype == DType::kBFloat16) {
    return LinearBf16(context, x_bf16, rows, in, weight_bf16, bias, out, y, ldy);
  }
  return Linear(context, x, rows, in, weight, bias, out, y, ldy);
}

absl::Status CudaPreparedLayer::ProjectForDecode(const float* x,
                                                 absl::Span<const int64_t> positions, float* q,
                                                 float* k, float* v) const {
  const MhaConfig& c = config_;
  const auto rows = static_cast<int64_t>(positions.size());
  if (rows == 0) return absl::OkStatus();
  const bool bf16 = c.compute_dtype == DType::kBFloat16;
  // Hidden states and positions go over in one copy; q, k and v come back in one.
  Arena arena;
  const int64_t x_at = arena.Add(rows * c.embed_dim * sizeof(float));
  const int64_t positions_at = arena.Add(rows * sizeof(int64_t));
  const int64_t input_bytes = arena.size();
  const int64_t q_at = arena.Add(rows * c.QWidth() * sizeof(float));
  const int64_t k_at = arena.Add(rows * c.KWidth() * sizeof(float));
  const int64_t v_at = arena.Add(rows * c.VWidth() * sizeof(float));
  const int64_t output_bytes = arena.size() - q_at;
  const int64_t rounded_at = bf16 ? arena.Add(rows * c.embed_dim * sizeof(uint16_t)) : -1;

  ASSIGN_OR_RETURN(StreamContext * context, backend_.Context());
  ASSIGN_OR_RETURN(char* device, context->device.Reserve(arena.size()));
  ASSIGN_OR_RETURN(char* staging, context->staging.Reserve(arena.size()));
  std::memcpy(staging + x_at, x, rows * c.embed_dim * sizeof(float));
  std::memcpy(staging + positions_at, positions.data(), rows * sizeof(int64_t));
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(device, staging, input_bytes, cudaMemcpyHostToDevice, context->stream),
      "cudaMemcpyAsync(decode inputs)"));
  const auto* x_device = reinterpret_cast<const float*>(device + x_at);
  auto* rounded = bf16 ? reinterpret_cast<uint16_t*>(device + rounded_at) : nullptr;
  RETURN_IF_ERROR(RoundForLayer(*context, x_device, rows * c.embed_dim, rounded));
  auto* q_device = reinterpret_cast<float*>(device + q_at);
  auto* k_device = reinterpret_cast<float*>(device + k_at);
  auto* v_device = reinterpret_cast<float*>(device + v_at);
  // Q, K and V apart (a fused layer's are row ranges of its matrix), straight into the rows
  // the caller gets back.
  RETURN_IF_ERROR(LinearInPrecision(*context, x_device, rounded, rows, c.embed_dim,
                                    weights_.q_weight, weights_.q_weight_bf16, weights_.q_bias,
                                    c.QWidth(), q_device, c.QWidth()));
  RETURN_IF_ERROR(LinearInPrecision(*context, x_device, rounded, rows, c.embed_dim,
                                    weights_.k_weight, weights_.k_weight_bf16, weights_.k_bias,
                                    c.KWidth(), k_device, c.KWidth()));
  RETURN_IF_ERROR(LinearInPrecision(*context, x_device, rounded, rows, c.embed_dim,
                                    weights_.v_weight, weights_.v_weight_bf16, weights_.v_bias,
                                    c.VWidth(), v_device, c.VWidth()));
  if (c.rope_theta > 0.0) {
    // Base theta: sessions refuse dynamic scaling (MhaLayer::DecodeSupport).
    const auto* positions_device = reinterpret_cast<const int64_t*>(device + positions_at);
    RETURN_IF_ERROR(
        CudaStatus(LaunchRotaryAt(q_device, rows, positions_device, c.num_heads, c.head_dim,
                                  c.rope_theta, c.rope_scaling, c.QWidth(), context->stream),
                   "rotary kernel"));
    RETURN_IF_ERROR(
        CudaStatus(LaunchRotaryAt(k_device, rows, positions_device, c.num_kv_heads, c.head_dim,
                                  c.rope_theta, c.rope_scaling, c.KWidth(), context->stream),
                   "rotary kernel"));
  }
  RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(staging + q_at, device + q_at, output_bytes,
                                             cudaMemcpyDeviceToHost, context->stream),
                             "cudaMemcpyAsync(decode q, k, v)"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(context->stream), "decode projections"));
  std::memcpy(q, staging + q_at, rows * c.QWidth() * sizeof(float));
  std::memcpy(k, staging + k_at, rows * c.KWidth() * sizeof(float));
  std::memcpy(v, staging + v_at, rows * c.VWidth() * sizeof(float));
  return absl::OkStatus();
}

absl::Status CudaPreparedLayer::ProjectDecodeOutput(const float* attended, int64_t rows,
                                                    float* output) const {
  const MhaConfig& c = config_;
  if (rows == 0) return absl::OkStatus();
  const bool bf16 = c.compute_dtype == DType::kBFloat16;
  Arena arena;
  const int64_t attended_at = arena.Add(rows * c.AttentionWidth() * sizeof(float));
  const int64_t output_at = arena.Add(rows * c.output_dim * sizeof(float));
  const int64_t rounded_at = bf16 ? arena.Add(rows * c.AttentionWidth() * sizeof(uint16_t)) : -1;

  ASSIGN_OR_RETURN(StreamContext * context, backend_.Context());
  ASSIGN_OR_RETURN(char* device, context->device.Reserve(arena.size()));
  ASSIGN_OR_RETURN(char* staging, context->staging.Reserve(arena.size()));
  std::memcpy(staging + attended_at, attended, rows * c.AttentionWidth() * sizeof(float));
  RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(device + attended_at, staging + attended_at,
                                             rows * c.AttentionWidth() * sizeof(float),
                                             cudaMemcpyHostToDevice, context->stream),
                             "cudaMemcpyAsync(attended rows)"));
  const auto* attended_device = reinterpret_cast<const float*>(device + attended_at);
  auto* rounded = bf16 ? reinterpret_cast<uint16_t*>(device + rounded_at) : nullptr;
  RETURN_IF_ERROR(RoundForLayer(*context, attended_device, rows * c.AttentionWidth(), rounded));
  RETURN_IF_ERROR(LinearInPrecision(*context, attended_device, rounded, rows, c.AttentionWidth(),
                                    weights_.out_weight, weights_.out_weight_bf16,
                                    weights_.out_bias, c.output_dim,
                                    reinterpret_cast<float*>(device + output_at), c.output_dim));
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(staging + output_at, device + output_at, rows * c.output_dim * sizeof(float),
                      cudaMemcpyDeviceToHost, context->stream),
      "cudaMemcpyAsync(decode output)"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(context->stream), "decode output projection"));
  std::memcpy(output, staging + output_at, rows * c.output_dim * sizeof(float));
  return absl::OkStatus();
}

}  // namespace attention::core::cuda

// The value types of multi-head attention shared by the layer and every backend: config,
// weights, one request's input, results.
#ifndef ATTENTION_CORE_MHA_TYPES_H_
#define ATTENTION_CORE_MHA_TYPES_H_

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/attention_options.h"
#include "core/dtype.h"

namespace attention::core {

// E = embed_dim, H = num_heads, Hkv = num_kv_heads, dk = head_dim, dv = v_head_dim.
// Zero in a dimension means "use the default" until Resolve() fills it in.
struct MhaConfig {
  int64_t embed_dim = 0;     // E, query input features; required
  int64_t num_heads = 0;     // H; required
  int64_t num_kv_heads = 0;  // Hkv, divides H; default H
  int64_t head_dim = 0;      // dk; default E / H
  int64_t v_head_dim = 0;    // dv; default dk
  int64_t kdim = 0;          // key input features; default E
  int64_t vdim = 0;          // value input features; default E
  int64_t output_dim = 0;    // default E with an output projection, else H * dv
  bool qkv_bias = true;
  bool output_bias = true;
  bool output_projection = true;
  double rope_theta = 0.0;  // 0 = no rotary embedding
  RopeScaling rope_scaling{};  // needs rope_theta
  bool always_causal = false;
  int64_t sliding_window = 0;  // 0 = none; needs always_causal
  // kFloat32, or kBFloat16: weights held in bf16, products in bf16 with float32
  // accumulation; softmax, masks and RoPE in float32.
  DType compute_dtype = DType::kFloat32;

  // Fills defaults and checks consistency; errors name the config.* field and values.
  static absl::StatusOr<MhaConfig> Resolve(MhaConfig config);

  int64_t QWidth() const { return num_heads * head_dim; }
  int64_t KWidth() const { return num_kv_heads * head_dim; }
  int64_t VWidth() const { return num_kv_heads * v_head_dim; }
  int64_t AttentionWidth() const { return num_heads * v_head_dim; }
  // The rotary base for a request of `seq_len` positions (dynamic scaling depends on it).
  double RotaryBaseFor(int64_t seq_len) const {
    return RotaryBase(rope_theta, rope_scaling, seq_len, head_dim);
  }
  // The options a request runs with: causal and the window as the layer says.
  AttentionOptions LayerOptions(const AttentionOptions& request) const {
    AttentionOptions options = request;
    options.causal = options.causal || always_causal;
    options.sliding_window = sliding_window;
    return options;
  }
  int64_t ParameterCount() const;
};

// Linear layers in PyTorch layout: weight [out_features, in_features], bias [out_features].
// Biases are empty when the config has none; out_* are empty without an output projection.
struct MhaWeights {
  std::vector<float> q_weight, k_weight, v_weight, out_weight;
  std::vector<float> q_bias, k_bias, v_bias, out_bias;

  // The tensors a config needs, by this project's names, with their expected sizes.
  struct Slot {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> MhaWeights::*member;
  };
  static std::vector<Slot> Slots(const MhaConfig& config);

  // Seeded, machine-independent init: every element uniform in
  // [-1/sqrt(fan_in), 1/sqrt(fan_in)], as nn.Linear's default distribution.
  static MhaWeights Random(const MhaConfig& config, uint64_t seed);
};

// One request to a layer: B sequences of Nq query rows (and Nk key rows), row-major.
// Where a layer call's query, key and value lie.
enum class InputMemory {
  // Host memory, which a device backend packs into its staging.
  kHost,
  // Page-locked host memory of the layer's backend (Backend::PinnedHostBuffer), from which
  // its device copies each tensor in one DMA.
  kPinnedHost,
  // The memory of the GPU the layer runs on (a caller's CUDA shared memory region, for a
  // backend that takes it: Backend::InPlaceGpu), copied on the device; nothing on the host
  // may read it.
  kGpu,
};

struct MhaInput {
  int64_t batch = 1;
  int64_t q_len = 1;
  int64_t kv_len = 1;                // equals q_len for self-attention
  absl::Span<const float> query;     // [B * Nq, E]
  absl::Span<const float> key;       // [B * Nk, kdim], empty for self-attention
  absl::Span<const float> value;     // [B * Nk, vdim], empty for self-attention
  AttentionOptions options;
  // 16-bit inputs as the wire sent them, for a backend that converts them on its device
  // (Backend::ConvertsHalfInputs): then query, key and value above are empty and these
  // hold as many elements of `half_dtype` (kFloat16 or kBFloat16).
  DType half_dtype = DType::kFloat32;
  absl::Span<const uint16_t> query_half, key_half, value_half;
  // Optional: where ForwardBatch writes this input's output ([B * Nq, output_dim]) instead
  // of AttentionResult::output, which then stays empty. The server points it into the
  // answer's bytes, so a large answer is not copied twice more on its way out.
  absl::Span<float> output_destination;
  // Optional, instead: the same rows rounded to bfloat16, for a caller that asked for a bf16
  // answer. A BFLOAT16 layer's output projection writes them so; other layers round their
  // float32 rows once on delivery.
  absl::Span<uint16_t> output_destination_bf16;
  // Where query, key and value (float32 or 16-bit, as above) are: see InputMemory.
  InputMemory inputs_memory = InputMemory::kHost;
  // Whether the output destination is an address in the memory of the GPU the layer runs
  // on (a caller's CUDA shared memory region), written there by the layer itself.
  bool output_on_gpu = false;

  bool is_half() const { return half_dtype != DType::kFloat32; }
  bool has_output_destination() const {
    return !output_destination.empty() || !output_destination_bf16.empty();
  }
  bool self_attention() const { return key.empty() && key_half.empty(); }
  int64_t query_elements() const { return is_half() ? query_half.size() : query.size(); }
  int64_t key_elements() const { return is_half() ? key_half.size() : key.size(); }
  int64_t value_elements() const { return is_half() ? value_half.size() : value.size(); }
};

// `input` with float32 query, key and value: itself, or its 16-bit inputs decoded into
// `storage` (which must outlive the result; a deque, so earlier results stay valid).
MhaInput WithFloatInputs(const MhaInput& input, std::deque<std::vector<float>>* storage);

// Whether OneSequence may take `input` apart: several sequences, no attention weights, no
// dropout, and no explicit mask shared by the whole batch (which each would copy).
bool SplitsIntoSequences(const MhaInput& input);
// Sequence `b` of `input`'s batch as an input of its own: its rows of the query, key and
// value (float32 or 16-bit) and its masks (AttentionOptions::OneSequence), answering into
// its rows of `batch_destination` (the whole batch's float32 output; empty for none) or of
// the input's bf16 destination.
MhaInput OneSequence(const MhaInput& input, int64_t b, absl::Span<float> batch_destination);

struct AttentionResult {
  // MHA: [B, Nq, output_dim] (empty when the input gave an output destination);
  // SDPA: [B, H, Nq, dv].
  std::vector<float> output;
  std::vector<float> weights;  // empty, [B, Nq, Nk] averaged or [B, H, Nq, Nk]
};

// A batch taken apart to run in pieces: each input whole, or each of its sequences
// (OneSequence) where SplitsIntoSequences, answering into its rows of its input's
// destination or, for an input without one, of results[n].output.
struct BatchParts {
  std::deque<MhaInput> sequences;
  std::vector<const MhaInput*> parts;
  std::vector<int64_t> whole_input;  // per part: the input it is, or -1 for a sequence
};
// `results` gets one entry per input, the output of each split input without a
// destination sized for its sequences to fill ([B, Nq, output_dim]); whole inputs' results
// are the caller's to move in.
BatchParts SplitBatch(absl::Span<const MhaInput* const> inputs, int64_t output_dim,
                      std::vector<AttentionResult>& results);

// For backends: hands one input's rows of a packed [rows, output_dim] output to the
// caller (`count` floats), into its output destination when it has one (rounded for a
// bf16 one), else into result->output.
void DeliverOutput(const MhaInput& input, const float* rows, int64_t count,
                   AttentionResult* result);

// Scaled dot-product attention on caller-given Q [B,H,Nq,dk], K [B,Hkv,Nk,dk], V [B,Hkv,Nk,dv].
struct SdpaInput {
  AttentionDims dims;
  absl::Span<const float> query, key, value;
  AttentionOptions options;
  // kBFloat16: scores and values multiplied in bf16 (Q, K, probabilities and V rounded,
  // float32 sums and softmax), as PyTorch's SDPA on bf16 tensors, where the backend has
  // bf16 products faster than float32 ones; elsewhere computed in float32. kFloat16: the
  // same in fp16 where cuDNN's fused SDPA takes the call (a GPU); elsewhere float32.
  DType compute_dtype = DType::kFloat32;
};
}  // namespace attention::core

#endif  // ATTENTION_CORE_MHA_TYPES_H_

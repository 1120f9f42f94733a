// A multi-head-attention layer: configuration, weights and its forward passes.
#ifndef ATTENTION_CORE_MHA_LAYER_H_
#define ATTENTION_CORE_MHA_LAYER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/attention_kernels.h"
#include "core/attention_options.h"
#include "core/thread_pool.h"

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
  bool always_causal = false;

  // Fills defaults and checks consistency; errors name the config.* field and values.
  static absl::StatusOr<MhaConfig> Resolve(MhaConfig config);

  int64_t QWidth() const { return num_heads * head_dim; }
  int64_t KWidth() const { return num_kv_heads * head_dim; }
  int64_t VWidth() const { return num_kv_heads * v_head_dim; }
  int64_t AttentionWidth() const { return num_heads * v_head_dim; }
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
struct MhaInput {
  int64_t batch = 1;
  int64_t q_len = 1;
  int64_t kv_len = 1;                // equals q_len for self-attention
  absl::Span<const float> query;     // [B * Nq, E]
  absl::Span<const float> key;       // [B * Nk, kdim], empty for self-attention
  absl::Span<const float> value;     // [B * Nk, vdim], empty for self-attention
  AttentionOptions options;
};

struct AttentionResult {
  std::vector<float> output;   // MHA: [B, Nq, output_dim]; SDPA: [B, H, Nq, dv]
  std::vector<float> weights;  // empty, [B, Nq, Nk] averaged or [B, H, Nq, Nk]
};

// Immutable once created; thread-safe.
class MhaLayer {
 public:
  // `config` must come from MhaConfig::Resolve; weight sizes are checked against it.
  static absl::StatusOr<std::shared_ptr<const MhaLayer>> Create(const MhaConfig& config,
                                                                MhaWeights weights);

  const MhaConfig& config() const { return config_; }
  // The weights as separate tensors (Q, K and V copied out when they are stored fused).
  MhaWeights weights() const;
  int64_t WeightBytes() const { return config_.ParameterCount() * 4; }

  // Checks shapes and options of `input`; errors name the request fields.
  absl::Status ValidateInput(const MhaInput& input) const;

  // The oracle: naive loops with double accumulation.
  AttentionResult ForwardReference(const MhaInput& input) const;

  // Production path for validated inputs: the projections of all inputs run over every
  // token of the batch at once (Q, K and V as one GEMM for self-attention when they are
  // fused), attention per sequence, head and query block, one GEMM for the output.
  std::vector<AttentionResult> ForwardBatch(absl::Span<const MhaInput* const> inputs,
                                            ThreadPool& pool) const;

 private:
  MhaLayer(const MhaConfig& config, MhaWeights weights);
  AttentionDims Dims(const MhaInput& input) const;
  // Q, K and V projection weights and biases, wherever they are stored.
  absl::Span<const float> QWeight() const;
  absl::Span<const float> KWeight() const;
  absl::Span<const float> VWeight() const;
  absl::Span<const float> QBias() const;
  absl::Span<const float> KBias() const;
  absl::Span<const float> VBias() const;

  MhaConfig config_;
  // Output projection always; Q, K and V only when they are not fused.
  MhaWeights weights_;
  // When kdim == vdim == E, Q, K and V live here as one [Q + K + V, E] matrix (rows in that
  // order), so self-attention projects every token with a single GEMM. Stored once, not
  // copied: the separate vectors in weights_ are then empty.
  std::vector<float> fused_qkv_weight_;
  std::vector<float> fused_qkv_bias_;
};

// Scaled dot-product attention on caller-given Q [B,H,Nq,dk], K [B,Hkv,Nk,dk], V [B,Hkv,Nk,dv].
struct SdpaInput {
  AttentionDims dims;
  absl::Span<const float> query, key, value;
  AttentionOptions options;
};
absl::Status ValidateSdpaInput(const SdpaInput& input);
AttentionResult SdpaReference(const SdpaInput& input);
AttentionResult SdpaForward(const SdpaInput& input, ThreadPool& pool);

// Rotary position embedding, rotate-half layout (Hugging Face Llama), in place on `rows`
// rows (`row_stride` floats apart) of `heads` heads of width dk; row r is at sequence
// position r % seq_len.
void ApplyRotary(float* data, int64_t rows, int64_t seq_len, int64_t heads, int64_t head_dim,
                 double theta, int64_t row_stride);

}  // namespace attention::core

#endif  // ATTENTION_CORE_MHA_LAYER_H_

#include "core/attention_kernels.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <utility>

#include "absl/types/span.h"
#include "core/cpu/amx_tiles.h"
#include "core/cpu/attention_cpu.h"
#include "core/cpu/cpu_backend.h"
#include "core/cpu/gemm_bf16.h"
#include "core/cuda/copy_overlap_plan.h"
#include "core/mha_layer.h"
#include "gtest/gtest.h"
#include "tests/core/fidelity.h"
#include "tests/core/random_options.h"
#include "tests/core/test_backends.h"

namespace attention::core {
namespace {

using testing::Describe;
using testing::FidelityStats;
using testing::RandomFloats;
using testing::RandomOptions;
using testing::TestSeed;
using testing::TrialsForThisBuild;

// The backend's answer to `input` against the float64 oracle, within FlashAttention's rule
// (tests/core/fidelity.h).
void ExpectFaithful(const AttentionResult& actual, const SdpaInput& input,
                    const std::string& what, FidelityStats& outputs, FidelityStats& weights) {
  const TextbookResult<float> textbook = SdpaTextbook<float>(input);
  const TextbookResult<double> oracle = SdpaTextbook<double>(input);
  EXPECT_TRUE(outputs.Check(actual.output, textbook.output, oracle.output)) << what << " output";
  EXPECT_TRUE(weights.Check(actual.weights, textbook.weights, oracle.weights))
      << what << " weights";
}

// `count` values uniform in [-1, 1) that bf16 holds exactly, as a bf16 tensor from the
// wire decodes.
std::vector<float> UniformBf16Floats(std::mt19937_64& rng, int64_t count) {
  const std::vector<uint16_t> bits = testing::UniformBf16(rng, count);
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = BFloat16ToFloat(bits[i]);
  return values;
}

// Uniform values that `dtype` (kBFloat16 or kFloat16) holds exactly.
std::vector<float> UniformHalfFloats(std::mt19937_64& rng, int64_t count, DType dtype) {
  std::vector<float> values = UniformBf16Floats(rng, count);
  if (dtype == DType::kFloat16) {
    for (float& value : values) value = HalfToFloat(FloatToHalf(value));
  }
  return values;
}

// Random SDPA dims: a batch of 1..max_batch, a (heads, KV heads) pair from `heads`, query
// and key lengths from `q_lengths` and `kv_lengths`, head sizes from `head_dims`.
AttentionDims RandomSdpaDims(std::mt19937_64& rng, int64_t max_batch,
                             absl::Span<const int64_t> q_lengths,
                             absl::Span<const int64_t> kv_lengths,
                             absl::Span<const int64_t> head_dims,
                             absl::Span<const std::pair<int64_t, int64_t>> heads) {
  auto pick = [&rng](auto values) {
    return values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng)];
  };
  AttentionDims dims;
  dims.batch = std::uniform_int_distribution<int64_t>(1, max_batch)(rng);
  std::tie(dims.num_heads, dims.num_kv_heads) = pick(heads);
  dims.q_len = pick(q_lengths);
  dims.kv_len = pick(kv_lengths);
  dims.head_dim = pick(head_dims);
  dims.v_head_dim = pick(head_dims);
  return dims;
}

// Q, K and V of `dims` uniform in [-1, 1) (RandomFloats, drawn in that order); PointAt makes
// an input read them.
struct SdpaTensors {
  std::vector<float> query, key, value;
  void PointAt(SdpaInput& input) const {
    input.query = query;
    input.key = key;
    input.value = value;
  }
};
SdpaTensors RandomSdpaTensors(std::mt19937_64& rng, const AttentionDims& d) {
  return {RandomFloats(rng, d.batch * d.num_heads * d.q_len * d.head_dim),
          RandomFloats(rng, d.batch * d.num_kv_heads * d.kv_len * d.head_dim),
          RandomFloats(rng, d.batch * d.num_kv_heads * d.kv_len * d.v_head_dim)};
}

// SDPA with compute_dtype `dtype` (BFLOAT16 or FLOAT16) on `backend` over a random grid of
// tensors of that type, against PyTorch's computation in it (SdpaHalfTextbook) by the
// 16-bit rule (tests/core/fidelity.h).
void ExpectSdpaHalfRule(const Backend& backend, const std::string& name, uint64_t seed,
                        DType dtype) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  // Up to 1100 keys: one pass, and the online softmax's two key blocks without weights.
  const int64_t lengths[] = {1, 7, 64, 67, 131, 300, 1100};
  const int64_t head_dims[] = {3, 16, 64, 70};
  const std::pair<int64_t, int64_t> heads[] = {{1, 1}, {2, 1}, {4, 2}, {3, 3}};
  const std::string type = dtype == DType::kBFloat16 ? "bf16" : "fp16";
  FidelityStats outputs("SDPA " + type + " output (" + name + ")"),
      weights("SDPA " + type + " weights (" + name + ")");
  for (int trial = 0; trial < TrialsForThisBuild(80) && !::testing::Test::HasFailure(); ++trial) {
    SdpaInput input;
    AttentionDims& dims = input.dims;
    dims = RandomSdpaDims(rng, 2, lengths, lengths, head_dims, heads);
    const auto q =
        UniformHalfFloats(rng, dims.batch * dims.num_heads * dims.q_len * dims.head_dim, dtype);
    const auto k =
        UniformHalfFloats(rng, dims.batch * dims.num_kv_heads * dims.kv_len * dims.head_dim, dtype);
    const auto v = UniformHalfFloats(
        rng, dims.batch * dims.num_kv_heads * dims.kv_len * dims.v_head_dim, dtype);
    input.query = q;
    input.key = k;
    input.value = v;
    input.options = RandomOptions(rng, dims);
    input.compute_dtype = dtype;
    ASSERT_TRUE(ValidateSdpaInput(input).ok()) << ValidateSdpaInput(input);
    const std::string what =
        "trial " + std::to_string(trial) + ": " + Describe(dims, input.options);
    const absl::StatusOr<AttentionResult> forward = backend.ScaledDotProductAttention(input);
    ASSERT_TRUE(forward.ok()) << forward.status();
    const TextbookResult<float> reference = SdpaHalfTextbook(input);
    const TextbookResult<double> oracle = SdpaTextbook<double>(input);
    EXPECT_TRUE(outputs.CheckHalf(forward->output, reference.output, oracle.output, dtype))
        << what << " output";
    EXPECT_TRUE(weights.CheckHalf(forward->weights, reference.weights, oracle.weights, dtype))
        << what << " weights";
  }
}

// Runs on every backend compiled in (see test_backends.h).
class SdpaBackendTest : public testing::BackendTest {};

TEST_P(SdpaBackendTest, Bf16ComputeFollowsTheBf16Rule) {
  ExpectSdpaHalfRule(*backend_, GetParam(), TestSeed(2911), DType::kBFloat16);
}

// FLOAT16 compute: on cuDNN where it takes the call, in float32 elsewhere (the CPU), which
// holds the fp16 rule with room.
TEST_P(SdpaBackendTest, Fp16ComputeFollowsTheFp16Rule) {
  ExpectSdpaHalfRule(*backend_, GetParam(), TestSeed(2913), DType::kFloat16);
}

// FLOAT16 calls cuDNN's fused SDPA takes (head sizes multiples of 8, no weights, no dropout,
// causal or not, GQA) must run there (a GPU machine whose cuDNN cannot load fails here; the
// plugin's start-up line says why) and follow the fp16 rule. SKIPPED where no GPU can run.
TEST(SdpaCudaTest, Fp16CallsRunOnCudnnWithinTheFp16Rule) {
  auto backend = testing::TestDevices().Get("cuda");
  if (!backend.ok()) GTEST_SKIP() << "backend cuda cannot run here: " << backend.status().message();
  const uint64_t seed = TestSeed(2915);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  const int64_t before = (*backend)->AttentionCallsByPath()["cudnn"];
  FidelityStats outputs("SDPA fp16 output (cuda, cuDNN calls)");
  for (int trial = 0; trial < 12 && !::testing::Test::HasFailure(); ++trial) {
    SdpaInput input;
    input.dims =
        RandomSdpaDims(rng, 3, std::vector<int64_t>{1, 17, 64, 130, 300},
                       std::vector<int64_t>{1, 64, 200, 513}, std::vector<int64_t>{64, 128},
                       std::vector<std::pair<int64_t, int64_t>>{{8, 2}, {4, 4}, {2, 1}});
    input.dims.v_head_dim = input.dims.head_dim;
    const AttentionDims& d = input.dims;
    const auto q =
        UniformHalfFloats(rng, d.batch * d.num_heads * d.q_len * d.head_dim, DType::kFloat16);
    const auto k =
        UniformHalfFloats(rng, d.batch * d.num_kv_heads * d.kv_len * d.head_dim, DType::kFloat16);
    const auto v =
        UniformHalfFloats(rng, d.batch * d.num_kv_heads * d.kv_len * d.v_head_dim, DType::kFloat16);
    input.query = q;
    input.key = k;
    input.value = v;
    input.options.causal = trial % 2 == 1 && d.q_len <= d.kv_len;
    input.compute_dtype = DType::kFloat16;
    ASSERT_TRUE(ValidateSdpaInput(input).ok()) << ValidateSdpaInput(input);
    const absl::StatusOr<AttentionResult> forward = (*backend)->ScaledDotProductAttention(input);
    ASSERT_TRUE(forward.ok()) << forward.status();
    EXPECT_TRUE(outputs.CheckHalf(forward->output, SdpaHalfTextbook(input).output,
                                  SdpaTextbook<double>(input).output, DType::kFloat16))
        << "trial " << trial << ": " << Describe(d, input.options);
  }
  EXPECT_GT((*backend)->AttentionCallsByPath()["cudnn"], before)
      << "no call ran on cuDNN's SDPA (ATTENTION_CUDNN_SDPA, or the plugin's start-up line)";
}

// Where float32 products are the host's fastest (or forced), bf16 compute is float32's.
TEST(AttentionCpuTest, SdpaInBf16OnFloat32ProductsIsTheFloat32Answer) {
  CpuKernelChoice float32_products;
  float32_products.bf16_products = Bf16Kernel::kPortable;
  const CpuBackend backend(2, float32_products);
  std::mt19937_64 rng(TestSeed(2914));
  SdpaInput input;
  input.dims = {1, 2, 1, 33, 70, 16, 8};
  const auto q = UniformBf16Floats(rng, 2 * 33 * 16), k = UniformBf16Floats(rng, 70 * 16),
             v = UniformBf16Floats(rng, 70 * 8);
  input.query = q;
  input.key = k;
  input.value = v;
  const absl::StatusOr<AttentionResult> float32 = backend.ScaledDotProductAttention(input);
  input.compute_dtype = DType::kBFloat16;
  const absl::StatusOr<AttentionResult> bf16 = backend.ScaledDotProductAttention(input);
  ASSERT_TRUE(float32.ok() && bf16.ok());
  EXPECT_EQ(bf16->output, float32->output);
}

// Sequences of a call run as a call of their own (SdpaSequences, the chunks a GPU call's
// copies overlap in) answer bitwise as their rows of the whole call, masks and weights
// included.
TEST(SdpaSequencesTest, PiecesAnswerAsTheirRowsOfTheWholeCall) {
  const uint64_t seed = TestSeed(4022);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  const int64_t lengths[] = {1, 5, 33, 70};
  const int64_t head_dims[] = {3, 16};
  const std::pair<int64_t, int64_t> heads[] = {{1, 1}, {4, 2}};
  const Backend& cpu = *testing::CpuForTests();
  for (int trial = 0; trial < TrialsForThisBuild(40) && !HasFailure(); ++trial) {
    SdpaInput input;
    input.dims = RandomSdpaDims(rng, 5, lengths, lengths, head_dims, heads);
    const AttentionDims& dims = input.dims;
    const SdpaTensors tensors = RandomSdpaTensors(rng, dims);
    tensors.PointAt(input);
    input.options = RandomOptions(rng, dims);
    input.options.dropout_p = 0.0f;  // its pattern follows the batch index
    const std::string what =
        "trial " + std::to_string(trial) + ": " + Describe(dims, input.options);
    const absl::StatusOr<AttentionResult> whole = cpu.ScaledDotProductAttention(input);
    ASSERT_TRUE(whole.ok()) << whole.status();
    const int64_t first = std::uniform_int_distribution<int64_t>(0, dims.batch - 1)(rng);
    const int64_t count = std::uniform_int_distribution<int64_t>(1, dims.batch - first)(rng);
    const SdpaInput piece = SdpaSequences(input, first, count);
    ASSERT_TRUE(ValidateSdpaInput(piece).ok()) << what << ": " << ValidateSdpaInput(piece);
    const absl::StatusOr<AttentionResult> answer = cpu.ScaledDotProductAttention(piece);
    ASSERT_TRUE(answer.ok()) << answer.status();
    const auto rows = [&](const std::vector<float>& all) {
      const size_t each = all.size() / dims.batch;
      return std::vector<float>(all.begin() + first * each, all.begin() + (first + count) * each);
    };
    EXPECT_EQ(answer->output, rows(whole->output))
        << what << ", sequences " << first << " + " << count;
    EXPECT_EQ(answer->weights, whole->weights.empty() ? whole->weights : rows(whole->weights))
        << what << ", sequences " << first << " + " << count;
  }
}

TEST(SdpaValidationTest, ComputeDTypeIsAFloatType) {
  SdpaInput input;
  input.dims = {1, 1, 1, 1, 1, 1, 1};
  const float one = 1.0f;
  input.query = input.key = input.value = absl::MakeConstSpan(&one, 1);
  input.compute_dtype = DType::kBool;
  const absl::Status status = ValidateSdpaInput(input);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "compute_dtype = BOOL is not a compute precision; expected FLOAT32, BFLOAT16 or "
            "FLOAT16");
}

TEST_P(SdpaBackendTest, SdpaMatchesReferenceOnRandomGrid) {
  const uint64_t seed = TestSeed(20261121);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  // 1, primes, block-size neighbours, and 257 / 300 queries so that over short keys
  // (256-row blocks) several query blocks occur.
  const int64_t lengths[] = {1, 2, 7, 63, 64, 67, 131, 257, 300};
  const int64_t head_dims[] = {1, 3, 8, 17};
  const std::pair<int64_t, int64_t> heads[] = {{1, 1}, {2, 1}, {4, 2}, {3, 3}, {6, 2}};
  FidelityStats outputs("SDPA grid output (" + GetParam() + ")"),
      weights("SDPA grid weights (" + GetParam() + ")");
  for (int trial = 0; trial < TrialsForThisBuild(300) && !HasFailure(); ++trial) {
    const AttentionDims dims = RandomSdpaDims(rng, 3, lengths, lengths, head_dims, heads);
    SdpaInput input;
    input.dims = dims;
    const SdpaTensors tensors = RandomSdpaTensors(rng, dims);
    tensors.PointAt(input);
    input.options = RandomOptions(rng, dims);
    ASSERT_TRUE(ValidateSdpaInput(input).ok()) << ValidateSdpaInput(input);
    const std::string what = "trial " + std::to_string(trial) + ": " + Describe(dims, input.options);
    const absl::StatusOr<AttentionResult> forward = backend_->ScaledDotProductAttention(input);
    ASSERT_TRUE(forward.ok()) << forward.status();
    ExpectFaithful(*forward, input, what, outputs, weights);
  }
}

TEST_P(SdpaBackendTest, SdpaMatchesReferenceWithLongKeys) {
  // 4100 keys give 64-row query blocks, so 150 queries span three blocks, and four key
  // blocks of the online softmax when no weights are returned.
  const uint64_t seed = TestSeed(77);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
    FidelityStats outputs("SDPA long keys output (" + GetParam() + ")"),
      weights("SDPA long keys weights (" + GetParam() + ")");
  for (int trial = 0; trial < 10 && !HasFailure(); ++trial) {
    SdpaInput input;
    input.dims = {1, 2, 1, 150, 4100, 8, 5};
    const auto q = RandomFloats(rng, 2 * 150 * 8), k = RandomFloats(rng, 4100 * 8),
               v = RandomFloats(rng, 4100 * 5);
    input.query = q;
    input.key = k;
    input.value = v;
    input.options = RandomOptions(rng, input.dims);
    // Without weights, key ranges over 1024 take the online-softmax path (4 key blocks).
    if (trial % 2 == 0) input.options.need_weights = NeedWeights::kNone;
    const std::string what = "trial " + std::to_string(trial) + ": " + Describe(input.dims, input.options);
    const absl::StatusOr<AttentionResult> forward = backend_->ScaledDotProductAttention(input);
    ASSERT_TRUE(forward.ok()) << forward.status();
    ExpectFaithful(*forward, input, what, outputs, weights);
  }
}

// A call that moves more than twice kOverlapChunkBytes with masks of its own per sequence:
// on the GPU it runs in chunks of sequences over two streams (core/cuda/copy_overlap_plan.h),
// elsewhere whole; within FlashAttention's rule either way. Few keys keep the oracle cheap.
TEST_P(SdpaBackendTest, CallsLargeEnoughToOverlapCopiesMatchTheReference) {
  const uint64_t seed = TestSeed(4021);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  SdpaInput input;
  AttentionDims& dims = input.dims;
  dims = {16, 4, 2, 512, 24, 64, 64};
  const SdpaTensors tensors = RandomSdpaTensors(rng, dims);
  tensors.PointAt(input);
  for (int64_t b = 0; b < dims.batch; ++b) {
    input.options.key_lengths.push_back(
        std::uniform_int_distribution<int64_t>(1, dims.kv_len)(rng));
  }
  input.options.attn_mask_dims = {dims.batch, 1, 1, dims.kv_len};
  input.options.attn_mask_bias = RandomFloats(rng, dims.batch * dims.kv_len);
  ASSERT_TRUE(ValidateSdpaInput(input).ok()) << ValidateSdpaInput(input);
  ASSERT_GE(cuda::PlanCopyOverlap(cuda::SdpaOverlapPartBytes(input)).size(), 3u)
      << "the call should be cut into chunks on a GPU";
  const absl::StatusOr<AttentionResult> forward = backend_->ScaledDotProductAttention(input);
  ASSERT_TRUE(forward.ok()) << forward.status();
  FidelityStats outputs("SDPA overlapped output (" + GetParam() + ")"),
      weights("SDPA overlapped weights (" + GetParam() + ")");
  ExpectFaithful(*forward, input, Describe(dims, input.options), outputs, weights);
}

TEST_P(SdpaBackendTest, CausalIsBottomRightAligned) {
  // Nq = 2 queries over Nk = 4 keys: query 0 sees keys 0..2, query 1 sees all four.
  SdpaInput input;
  input.dims = {1, 1, 1, 2, 4, 1, 1};
  const std::vector<float> q = {0, 0}, k = {0, 0, 0, 0}, v = {1, 2, 3, 4};
  input.query = q;
  input.key = k;
  input.value = v;
  input.options.causal = true;
  input.options.need_weights = NeedWeights::kPerHead;
  const absl::StatusOr<AttentionResult> forward = backend_->ScaledDotProductAttention(input);
  ASSERT_TRUE(forward.ok()) << forward.status();
  for (const AttentionResult& result : {SdpaReference(input), *forward}) {
    EXPECT_NEAR(result.output[0], 2.0f, 1e-6);  // mean of 1, 2, 3
    EXPECT_NEAR(result.output[1], 2.5f, 1e-6);  // mean of 1..4
    EXPECT_EQ(result.weights[3], 0.0f);
  }
}

TEST_P(SdpaBackendTest, FullyMaskedRowIsZeroNotNan) {
  SdpaInput input;
  input.dims = {2, 1, 1, 3, 5, 4, 4};
  std::mt19937_64 rng(7);
  const auto q = RandomFloats(rng, 2 * 3 * 4), k = RandomFloats(rng, 2 * 5 * 4),
             v = RandomFloats(rng, 2 * 5 * 4);
  input.query = q;
  input.key = k;
  input.value = v;
  input.options.key_lengths = {0, 5};  // sequence 0 has no valid key
  input.options.need_weights = NeedWeights::kPerHead;
  const absl::StatusOr<AttentionResult> forward = backend_->ScaledDotProductAttention(input);
  ASSERT_TRUE(forward.ok()) << forward.status();
  for (const AttentionResult& result : {SdpaReference(input), *forward}) {
    for (int e = 0; e < 3 * 4; ++e) EXPECT_EQ(result.output[e], 0.0f) << e;
    for (int e = 0; e < 3 * 5; ++e) EXPECT_EQ(result.weights[e], 0.0f) << e;
    for (int e = 12; e < 24; ++e) EXPECT_NE(result.output[e], 0.0f) << e;
  }
}

TEST(AttentionCpuTest, LongKeysTakeShortQueryBlocks) {
  // The long-keys test above relies on this: 150 queries span three blocks of 64.
  EXPECT_EQ(QueryBlockRows(4100), 64);
  EXPECT_EQ(QueryBlockRows(512), 512);
  EXPECT_EQ(QueryBlockRows(16), 512);
}

// A BFLOAT16 layer's projections hand attention Q, K and V already rounded to bf16, and take
// its answer in bf16: the kernel must give the bits it gives when it rounds float32 rows
// itself, on every path (short and online key ranges, several query blocks, masks, causal,
// dropout, GQA, odd head sizes).
// Each bf16 kernel the CPU runs: AVX512-BF16, and AMX's tiles.
class AttentionBf16ProductsTest : public ::testing::TestWithParam<Bf16Kernel> {
 protected:
  void SetUp() override {
    if (!CpuSupports(GetParam())) {
      GTEST_SKIP() << "this CPU cannot run " << Bf16KernelName(GetParam())
                   << (GetParam() == Bf16Kernel::kAmx ? ": " + AmxUnavailableReason() : "");
    }
  }
};

TEST_P(AttentionBf16ProductsTest, Bf16SourcesGiveTheBitsOfFloat32RowsRoundedInTheKernel) {
  const Bf16Kernel kernel = GetParam();
  const uint64_t seed = TestSeed(2611);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  const int64_t q_lengths[] = {1, 7, 67, 600};
  const int64_t kv_lengths[] = {1, 16, 67, 513, 1500};
  const int64_t head_dims[] = {3, 16, 64, 70};
  const std::pair<int64_t, int64_t> heads[] = {{1, 1}, {2, 1}, {4, 2}};
  ThreadPool pool(2);
  for (int trial = 0; trial < 60 && !HasFailure(); ++trial) {
    SdpaInput input;
    AttentionDims& dims = input.dims;
    dims = RandomSdpaDims(rng, 2, q_lengths, kv_lengths, head_dims, heads);
    input.options = RandomOptions(rng, dims);
    input.options.need_weights = NeedWeights::kNone;  // bf16 sources are never asked for them
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + Describe(dims, input.options));
    const auto q = RandomFloats(rng, dims.batch * dims.num_heads * dims.q_len * dims.head_dim);
    const auto k = RandomFloats(rng, dims.batch * dims.num_kv_heads * dims.kv_len * dims.head_dim);
    const auto v =
        RandomFloats(rng, dims.batch * dims.num_kv_heads * dims.kv_len * dims.v_head_dim);
    const auto rounded = [](const std::vector<float>& x) {
      std::vector<uint16_t> bf16(x.size());
      RoundToBf16(x.data(), static_cast<int64_t>(x.size()), bf16.data());
      return bf16;
    };
    const std::vector<uint16_t> q16 = rounded(q), k16 = rounded(k), v16 = rounded(v);
    const size_t outputs = dims.batch * dims.num_heads * dims.q_len * dims.v_head_dim;
    std::vector<float> from_float32(outputs, 7.0f), from_bf16(outputs, -7.0f);
    AttentionProblem problem =
        SdpaProblem<float>(input, q.data(), k.data(), v.data(), from_float32.data(), nullptr);
    problem.bf16_products = true;
    AttentionBlockedCpu({&problem, 1}, pool, kernel);
    problem.query = problem.key = problem.value = nullptr;
    problem.query_bf16 = q16.data();
    problem.key_bf16 = k16.data();
    problem.value_bf16 = v16.data();
    problem.output = from_bf16.data();
    AttentionBlockedCpu({&problem, 1}, pool, kernel);
    ASSERT_EQ(std::memcmp(from_float32.data(), from_bf16.data(), outputs * sizeof(float)), 0);
    // Answered in bf16 (what the output projection reads): the float32 answer rounded.
    std::vector<uint16_t> answered_bf16(outputs, 0x7777);
    problem.output = nullptr;
    problem.output_bf16 = answered_bf16.data();
    AttentionBlockedCpu({&problem, 1}, pool, kernel);
    ASSERT_EQ(answered_bf16, rounded(from_float32));
    // And from float32 rows (a RoPE layer's, rotated in float32), answered in bf16.
    std::fill(answered_bf16.begin(), answered_bf16.end(), uint16_t{0x7777});
    problem.query_bf16 = problem.key_bf16 = problem.value_bf16 = nullptr;
    problem.query = q.data();
    problem.key = k.data();
    problem.value = v.data();
    AttentionBlockedCpu({&problem, 1}, pool, kernel);
    ASSERT_EQ(answered_bf16, rounded(from_float32));
  }
}

// SDPA asked for bf16 compute multiplies on the backend's bf16 kernel (bit for bit the
// kernel's answer, so the path is the one named), within the bf16 rule.
TEST_P(AttentionBf16ProductsTest, SdpaInBf16RunsOnThisKernelWithinTheBf16Rule) {
  CpuKernelChoice kernels;
  kernels.bf16_products = GetParam();
  const CpuBackend backend(2, kernels);
  ExpectSdpaHalfRule(backend, Bf16KernelName(GetParam()), TestSeed(2912), DType::kBFloat16);
  std::mt19937_64 rng(TestSeed(2913));
  SdpaInput input;
  input.dims = {2, 4, 2, 67, 300, 64, 64};
  const auto q = UniformBf16Floats(rng, 2 * 4 * 67 * 64);
  const auto kv = UniformBf16Floats(rng, 2 * 2 * 300 * 64);
  input.query = q;
  input.key = input.value = kv;
  input.compute_dtype = DType::kBFloat16;
  const absl::StatusOr<AttentionResult> answer = backend.ScaledDotProductAttention(input);
  ASSERT_TRUE(answer.ok()) << answer.status();
  std::vector<float> expected(answer->output.size());
  AttentionProblem problem =
      SdpaProblem<float>(input, q.data(), kv.data(), kv.data(), expected.data(), nullptr);
  ASSERT_TRUE(problem.bf16_products);
  ThreadPool pool(2);
  AttentionBlockedCpu({&problem, 1}, pool, GetParam());
  EXPECT_EQ(answer->output, expected);
}

INSTANTIATE_TEST_SUITE_P(Kernels, AttentionBf16ProductsTest,
                         ::testing::Values(Bf16Kernel::kAvx512Bf16, Bf16Kernel::kAmx),
                         [](const ::testing::TestParamInfo<Bf16Kernel>& info) {
                           return std::string(Bf16KernelName(info.param));
                         });

// The measured choice of attention's bf16 products runs here, and the report names each
// kernel this host runs.
TEST(AttentionCpuTest, MeasuredBf16ProductsRunHereAndTheReportNamesEachCandidate) {
  EXPECT_TRUE(CpuSupportsBf16Products(FastestBf16Products()));
  const std::string report = Bf16ProductsReport();
  for (const Bf16Kernel kernel :
       {Bf16Kernel::kAmx, Bf16Kernel::kAvx512Bf16, Bf16Kernel::kPortable}) {
    EXPECT_EQ(report.find(std::string(Bf16ProductsName(kernel)) + " ") != std::string::npos,
              CpuSupportsBf16Products(kernel))
        << report;
    EXPECT_EQ(*ParseBf16Products(Bf16ProductsName(kernel)), kernel);
  }
  const absl::StatusOr<Bf16Kernel> unknown = ParseBf16Products("onednn");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unknown.status().message(),
            "bf16 attention kernel \"onednn\" is not one of amx, avx512_bf16, float32");
}

TEST(AttentionKernelsTest, DropoutDependsOnlyOnSeedAndPosition) {
  EXPECT_EQ(DropoutKeeps(5, 0.5f, 1, 2, 3, 4), DropoutKeeps(5, 0.5f, 1, 2, 3, 4));
  int kept = 0;
  for (int j = 0; j < 10000; ++j) kept += DropoutKeeps(99, 0.3f, 0, 0, 0, j);
  EXPECT_NEAR(kept / 10000.0, 0.7, 0.02);
  EXPECT_TRUE(DropoutKeeps(99, 0.0f, 0, 0, 0, 0));
}

TEST(AttentionOptionsTest, ValidateNamesFieldAndValues) {
  const AttentionDims dims{2, 4, 2, 3, 5, 8, 8};
  AttentionOptions options;
  options.key_lengths = {1, 6};
  EXPECT_EQ(options.Validate(dims).message(), "options.key_lengths[1] = 6 is outside [0, 5] (Nk)");
  options = {};
  options.dropout_p = 1.0f;
  EXPECT_EQ(options.Validate(dims).message(), "options.dropout_p = 1 is outside [0, 1)");
  options = {};
  options.scale = std::numeric_limits<float>::infinity();
  EXPECT_EQ(options.Validate(dims).code(), absl::StatusCode::kInvalidArgument);
  options = {};
  options.attn_mask_dims = {1, 3, 3, 5};
  options.attn_mask_keep.assign(45, 1);
  EXPECT_EQ(options.Validate(dims).message(),
            "options.attn_mask shape [1, 3, 3, 5] is not broadcastable to [B, H, Nq, Nk] = "
            "[2, 4, 3, 5]");
}

INSTANTIATE_TEST_SUITE_P(Devices, SdpaBackendTest, ::testing::ValuesIn(testing::CompiledDevices()),
                         testing::DeviceTestName);

}  // namespace
}  // namespace attention::core

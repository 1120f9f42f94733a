// Which calls go to cuDNN's SDPA, their length buckets and the graph cache
// (core/cuda/cudnn_sdpa_plan.h): host-side logic, checked on any machine.
#include "core/cuda/cudnn_sdpa_plan.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace attention::core::cuda {
namespace {

constexpr int kHopper = 9;
constexpr int64_t kCudnn919 = 91900;

// A bf16 layer's plain call cuDNN takes: GQA 4:1, Llama heads.
CudnnSdpaCall Eligible() {
  CudnnSdpaCall call;
  call.shape = {2, 32, 8, 100, 300, 128, 128};
  call.bf16_products = true;
  return call;
}

TEST(CudnnSdpaPlanTest, TakesBf16CallsWithCausalWindowsAndGqa) {
  EXPECT_EQ(CudnnSdpaIneligibleReason(Eligible(), kHopper, kCudnn919), "");
  CudnnSdpaCall causal = Eligible();
  causal.causal = true;
  EXPECT_EQ(CudnnSdpaIneligibleReason(causal, kHopper, kCudnn919), "");
  causal.sliding_window = 64;
  EXPECT_EQ(CudnnSdpaIneligibleReason(causal, 8, kCudnn919), "");
  CudnnSdpaCall padded = Eligible();
  padded.key_lengths = {1, 300};
  EXPECT_EQ(CudnnSdpaIneligibleReason(padded, kHopper, kCudnn919), "");
  CudnnSdpaCall odd = Eligible();
  odd.shape.head_dim = 64;
  odd.shape.v_head_dim = 8;
  odd.shape.num_kv_heads = 1;  // MQA
  EXPECT_EQ(CudnnSdpaIneligibleReason(odd, kHopper, kCudnn919), "");
}

// Each refusal names what cuDNN cannot take; such calls stay on the project's kernels.
TEST(CudnnSdpaPlanTest, RefusesWhatCudnnCannotExpressNamingIt) {
  struct Case {
    const char* what;
    void (*change)(CudnnSdpaCall&);
    const char* reason;
  };
  const Case cases[] = {
      {"float32", [](CudnnSdpaCall& c) { c.bf16_products = false; }, "compute precision float32"},
      {"weights", [](CudnnSdpaCall& c) { c.weights = true; }, "need_weights"},
      {"dropout", [](CudnnSdpaCall& c) { c.dropout = true; }, "dropout_p > 0"},
      {"masks", [](CudnnSdpaCall& c) { c.other_masks = true; },
       "key padding that keeps a key after one it drops"},
      {"empty key lengths",
       [](CudnnSdpaCall& c) {
         c.key_lengths = {300, 0};
       },
       "key_lengths[1] = 0: rows with no key"},
      {"causal key lengths",
       [](CudnnSdpaCall& c) {
         c.key_lengths = {300, 7};
         c.causal = true;
       },
       "key_lengths with causal"},
      {"window", [](CudnnSdpaCall& c) { c.sliding_window = 4; }, "sliding_window without causal"},
      {"empty rows",
       [](CudnnSdpaCall& c) {
         c.causal = true;
         c.shape.q_len = 301;
       },
       "causal with q_len 301 > kv_len 300"},
      {"dk", [](CudnnSdpaCall& c) { c.shape.head_dim = 12; }, "head_dim 12: cuDNN takes multiples"},
      {"dk wide", [](CudnnSdpaCall& c) { c.shape.head_dim = 136; }, "head_dim 136"},
      {"dv", [](CudnnSdpaCall& c) { c.shape.v_head_dim = 4; }, "v_head_dim 4"},
      {"groups", [](CudnnSdpaCall& c) { c.shape.num_kv_heads = 5; },
       "num_heads 32 not a multiple of num_kv_heads 5"},
  };
  for (const Case& c : cases) {
    CudnnSdpaCall call = Eligible();
    c.change(call);
    const std::string reason = CudnnSdpaIneligibleReason(call, kHopper, kCudnn919);
    EXPECT_NE(reason.find(c.reason), std::string::npos) << c.what << ": " << reason;
  }
  EXPECT_EQ(CudnnSdpaIneligibleReason(Eligible(), 7, kCudnn919),
            "compute capability 7.x: cuDNN's SDPA needs 8.0");
  EXPECT_EQ(CudnnSdpaIneligibleReason(Eligible(), kHopper, 90400),
            "cuDNN 90400 is older than 90500");
}

// Right-padded masks (ones, then zeros) and key lengths become cuDNN's padding lengths; a mask
// that keeps a key after one it drops cannot.
TEST(CudnnSdpaPlanTest, PrefixMasksBecomeKeyLengths) {
  std::vector<int64_t> lengths;
  const uint8_t keep[] = {1, 1, 1, 0, 0,   // 3 keys
                          1, 1, 1, 1, 1,   // all 5, cut to 4 by its key length
                          0, 0, 0, 0, 0};  // none
  const int64_t key_lengths[] = {5, 4, 2};
  ASSERT_TRUE(PrefixKeyLengths(key_lengths, keep, 3, 5, &lengths));
  EXPECT_EQ(lengths, (std::vector<int64_t>{3, 4, 0}));
  ASSERT_TRUE(PrefixKeyLengths(nullptr, keep, 3, 5, &lengths));
  EXPECT_EQ(lengths, (std::vector<int64_t>{3, 5, 0}));
  ASSERT_TRUE(PrefixKeyLengths(key_lengths, nullptr, 3, 5, &lengths));
  EXPECT_EQ(lengths, (std::vector<int64_t>{5, 4, 2}));
  const uint8_t gap[] = {1, 0, 1, 1, 1};  // keeps keys 2-4 after dropping key 1
  EXPECT_FALSE(PrefixKeyLengths(nullptr, gap, 1, 5, &lengths));
  const int64_t short_length[] = {1};  // ... unless its key length ends before the gap
  ASSERT_TRUE(PrefixKeyLengths(short_length, gap, 1, 5, &lengths));
  EXPECT_EQ(lengths, (std::vector<int64_t>{1}));
}

TEST(CudnnSdpaPlanTest, BucketsPadAtMostAnEighthPast64) {
  EXPECT_EQ(CudnnSdpaSequenceBucket(1), 64);
  EXPECT_EQ(CudnnSdpaSequenceBucket(64), 64);
  EXPECT_EQ(CudnnSdpaSequenceBucket(65), 72);
  EXPECT_EQ(CudnnSdpaSequenceBucket(2048), 2048);
  EXPECT_EQ(CudnnSdpaSequenceBucket(2049), 2304);
  int64_t buckets = 0, last = 0;
  for (int64_t length = 1; length <= 131072; ++length) {
    const int64_t bucket = CudnnSdpaSequenceBucket(length);
    ASSERT_GE(bucket, length);
    if (length > 64) {
      ASSERT_LE(8 * (bucket - length), length) << length;
    }
    ASSERT_GE(bucket, last) << length;  // monotone: a longer call never gets a smaller graph
    buckets += bucket != last;
    last = bucket;
  }
  EXPECT_LE(buckets, 100);  // few graphs for every length up to 128k
}

TEST(CudnnSdpaPlanTest, KeysShareAGraphWithinABucketOnly) {
  CudnnSdpaCall a = Eligible(), b = Eligible();
  b.shape.q_len = 97;
  b.shape.kv_len = 310;
  EXPECT_EQ(CudnnSdpaKeyOf(a, 0.125f), CudnnSdpaKeyOf(b, 0.125f));
  EXPECT_FALSE(CudnnSdpaKeyOf(a, 0.125f) == CudnnSdpaKeyOf(a, 0.126f));
  b.shape.kv_len = 400;
  EXPECT_FALSE(CudnnSdpaKeyOf(a, 0.125f) == CudnnSdpaKeyOf(b, 0.125f));
  b = a;
  b.causal = true;
  EXPECT_FALSE(CudnnSdpaKeyOf(a, 0.125f) == CudnnSdpaKeyOf(b, 0.125f));
  b.sliding_window = 16;
  EXPECT_FALSE(CudnnSdpaKeyOf(a, 0.125f) == CudnnSdpaKeyOf(b, 0.125f));
  // An fp16 call's graph is another (its tensors are fp16).
  b = a;
  b.bf16_products = false;
  b.fp16_products = true;
  EXPECT_TRUE(CudnnSdpaKeyOf(b, 0.125f).fp16);
  EXPECT_FALSE(CudnnSdpaKeyOf(a, 0.125f) == CudnnSdpaKeyOf(b, 0.125f));
}

// A FLOAT16 scaled dot-product attention call goes to cuDNN as a bf16 one does.
TEST(CudnnSdpaPlanTest, TakesFp16CallsAsBf16Ones) {
  CudnnSdpaCall fp16 = Eligible();
  fp16.bf16_products = false;
  fp16.fp16_products = true;
  EXPECT_EQ(CudnnSdpaIneligibleReason(fp16, kHopper, kCudnn919), "");
  fp16.weights = true;
  EXPECT_EQ(CudnnSdpaIneligibleReason(fp16, kHopper, kCudnn919),
            "need_weights: cuDNN's SDPA returns no attention weights");
}

TEST(CudnnSdpaPlanTest, CacheEvictsTheLeastRecentlyUsedPastItsCapacity) {
  BoundedGraphCache<int> cache(2);
  auto key = [](int64_t q) {
    CudnnSdpaGraphKey k;
    k.q_bucket = q;
    return k;
  };
  EXPECT_EQ(cache.Find(key(1)), nullptr);
  cache.Add(key(1), 10);
  cache.Add(key(2), 20);
  ASSERT_NE(cache.Find(key(1)), nullptr);  // 1 is now the most recently used
  cache.Add(key(3), 30);                   // evicts 2
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(cache.Find(key(2)), nullptr);
  ASSERT_NE(cache.Find(key(1)), nullptr);
  EXPECT_EQ(*cache.Find(key(1)), 10);
  ASSERT_NE(cache.Find(key(3)), nullptr);
  EXPECT_EQ(*cache.Find(key(3)), 30);
}

// A bf16 layer's session step over a bf16 pool of 256 KiB blocks cuDNN takes: Llama heads,
// decode steps of three sessions.
CudnnPagedCall EligibleStep() {
  CudnnPagedCall call;
  call.num_heads = 32;
  call.num_kv_heads = 8;
  call.head_dim = call.v_head_dim = 128;
  call.bf16_kv = call.bf16_products = true;
  call.block_bytes = 256 << 10;
  call.tokens_per_block = call.block_bytes / (8 * 256 * 2);
  call.num_blocks = 4096;
  call.storage_address = 0x7f0000000000;
  call.lengths = {4096, 17, 900};
  call.num_queries = {1, 1, 1};
  return call;
}

TEST(CudnnPagedPlanTest, TakesBf16LayersStepsAndRefusesTheRestNamingWhy) {
  EXPECT_EQ(CudnnPagedIneligibleReason(EligibleStep(), kHopper, kCudnn919), "");
  CudnnPagedCall windowed = EligibleStep();
  windowed.sliding_window = 4096;
  windowed.num_queries = {1, 17, 256};  // chunks of a prefill beside decode steps
  EXPECT_EQ(CudnnPagedIneligibleReason(windowed, 8, kCudnn919), "");

  const auto refused = [](void (*change)(CudnnPagedCall&), int sm_major, int64_t version) {
    CudnnPagedCall call = EligibleStep();
    change(call);
    return CudnnPagedIneligibleReason(call, sm_major, version);
  };
  const auto same = [](CudnnPagedCall&) {};
  EXPECT_EQ(refused(same, kHopper, 90400), "cuDNN 90400 is older than 90500");
  EXPECT_EQ(refused(same, 7, kCudnn919), "compute capability 7.x: cuDNN's SDPA needs 8.0");
  EXPECT_EQ(refused([](CudnnPagedCall& c) { c.bf16_kv = false; }, kHopper, kCudnn919),
            "float32 KV: cuDNN's SDPA is bf16 or fp16");
  EXPECT_EQ(refused([](CudnnPagedCall& c) { c.bf16_products = false; }, kHopper, kCudnn919),
            "a session that computes in float32 (no BFLOAT16 layer): cuDNN rounds the queries "
            "and probabilities to bf16");
  EXPECT_EQ(refused([](CudnnPagedCall& c) { c.log_sum_exp = true; }, kHopper, kCudnn919),
            "log-sum-exps asked for: the project's kernel returns them");
  EXPECT_EQ(refused([](CudnnPagedCall& c) { c.shared_prefixes = true; }, kHopper, kCudnn919),
            "forks of one prefix: the project's kernel reads it once");
  EXPECT_EQ(refused([](CudnnPagedCall& c) { c.v_head_dim = 100; }, kHopper, kCudnn919),
            "v_head_dim 100: cuDNN takes multiples of 8 up to 128");
  EXPECT_EQ(refused([](CudnnPagedCall& c) { c.head_dim = 256; }, kHopper, kCudnn919),
            "head_dim 256: cuDNN takes multiples of 8 up to 128");
  EXPECT_EQ(refused([](CudnnPagedCall& c) { c.num_heads = 12; }, kHopper, kCudnn919),
            "num_heads 12 not a multiple of num_kv_heads 8");
  EXPECT_EQ(refused([](CudnnPagedCall& c) { c.block_bytes = 1000; }, kHopper, kCudnn919),
            "block_bytes 1000 or the pool's address not 16-byte aligned");
  EXPECT_EQ(refused([](CudnnPagedCall& c) { c.storage_address += 8; }, kHopper, kCudnn919),
            "block_bytes 262144 or the pool's address not 16-byte aligned");
  EXPECT_EQ(refused([](CudnnPagedCall& c) { c.lengths[1] = int64_t{1} << 31; }, kHopper, kCudnn919),
            "lengths[1] = 2147483648: lengths are int32");
}

TEST(CudnnPagedPlanTest, GraphsPadTheBatchToAPowerOfTwoAndDecodeStepsToOneQuery) {
  const CudnnPagedCall call = EligibleStep();  // 3 sequences, the longest 4096 keys
  const CudnnSdpaGraphKey key = CudnnPagedKeyOf(call, 0.125f);
  EXPECT_TRUE(key.paged());
  EXPECT_EQ(key.batch, 4);
  EXPECT_EQ(key.q_bucket, 1) << "cuDNN's decode path";
  EXPECT_FALSE(key.causal) << "one query sees every key it holds";
  CudnnPagedCall windowed = call;
  windowed.sliding_window = 1024;
  EXPECT_TRUE(CudnnPagedKeyOf(windowed, 0.125f).causal) << "a band aligned to the bottom right";
  EXPECT_EQ(key.tokens_per_block, 64);
  EXPECT_EQ(key.pages, 64);
  EXPECT_EQ(key.kv_bucket, 4096);
  EXPECT_EQ(key.num_blocks, 4096);
  EXPECT_EQ(key.block_elements, 128 << 10) << "bf16 elements from a block to the next";
  // A context in the same bucket shares the graph; a longer one or a chunk of queries does not.
  CudnnPagedCall shorter = call;
  shorter.lengths[0] = 4000;
  EXPECT_TRUE(CudnnPagedKeyOf(shorter, 0.125f) == key);
  CudnnPagedCall longer = call;
  longer.lengths[0] = 4100;
  EXPECT_EQ(CudnnPagedKeyOf(longer, 0.125f).pages, 72) << "bucket 4608 keys";
  CudnnPagedCall chunk = call;
  chunk.num_queries = {1, 17, 200};
  const CudnnSdpaGraphKey chunked = CudnnPagedKeyOf(chunk, 0.125f);
  EXPECT_EQ(chunked.q_bucket, CudnnSdpaSequenceBucket(200));
  EXPECT_TRUE(chunked.causal) << "bottom-right, as the sessions' queries sit at the end";
  EXPECT_FALSE(chunked == key);
  CudnnPagedCall five = call;
  five.lengths = {1, 2, 3, 4, 5};
  five.num_queries = {1, 1, 1, 1, 1};
  EXPECT_EQ(CudnnPagedKeyOf(five, 0.125f).batch, 8);
  // A paged graph is never a dense one of the same heads.
  CudnnSdpaCall dense;
  dense.shape = {4, 32, 8, 1, 4096, 128, 128};
  EXPECT_FALSE(CudnnSdpaKeyOf(dense, 0.125f) == key);
  EXPECT_FALSE(CudnnSdpaKeyOf(dense, 0.125f).paged());
}

TEST(CudnnPagedPlanTest, PageTablesHoldEachSequencesBlocksAndPadWithBlockZero) {
  CudnnSdpaGraphKey key;
  key.batch = 4;
  key.pages = 3;
  key.tokens_per_block = 16;
  const std::vector<std::vector<int32_t>> tables = {{7, 9}, {4, 5, 6, 8}, {2}};
  const std::vector<PagedDecodeSequence> sequences = {
      {tables[0], 20, 1, nullptr, nullptr, nullptr},
      {tables[1], 33, 2, nullptr, nullptr, nullptr},
      {tables[2], 16, 16, nullptr, nullptr, nullptr}};
  struct {
    std::vector<int32_t> q_lengths, kv_lengths, page_table;
  } arrays;
  arrays.q_lengths.assign(4, -1);
  arrays.kv_lengths.assign(4, -1);
  arrays.page_table.assign(12, -1);
  WriteCudnnPagedArrays(key, sequences, arrays.q_lengths.data(), arrays.kv_lengths.data(),
                        arrays.page_table.data());
  EXPECT_EQ(arrays.q_lengths, (std::vector<int32_t>{1, 2, 16, 1}));
  EXPECT_EQ(arrays.kv_lengths, (std::vector<int32_t>{20, 33, 16, 1}));
  // Sequence 1 reserves a fourth block past its 33 keys: only the three it uses are read.
  EXPECT_EQ(arrays.page_table, (std::vector<int32_t>{7, 9, 0, 4, 5, 6, 2, 0, 0, 0, 0, 0}));
}

}  // namespace
}  // namespace attention::core::cuda

// Which calls go to cuDNN's SDPA, their length buckets and the graph cache
// (core/cuda/cudnn_sdpa_plan.h): host-side logic, checked on any machine.
#include "core/cuda/cudnn_sdpa_plan.h"

#include <string>

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

}  // namespace
}  // namespace attention::core::cuda

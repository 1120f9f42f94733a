// libattention_cudnn_sdpa.so (see cudnn_sdpa_library.h): cuDNN's fused SDPA through the
// cuDNN frontend's graph API, one graph per CudnnSdpaGraphKey, built on first use and kept
// in a bounded cache per runner.
#include <cudnn.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <iostream>
#include <memory>
#include <string>
#include <unordered_map>

#include <cudnn_frontend.h>

#include "core/cuda/cudnn_sdpa_library.h"
#include "core/cuda/cudnn_sdpa_plan.h"

namespace attention::core::cuda {
namespace {

namespace fe = cudnn_frontend;

// Tensor ids of the variant pack.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kQLengths, kKvLengths, kPageTableK, kPageTableV };

std::string CudnnError(const char* what, cudnnStatus_t status) {
  return std::string(what) + ": " + cudnnGetErrorString(status);
}

// Dense row-major strides of [b, h, s, d].
std::vector<int64_t> DenseStrides(int64_t heads, int64_t length, int64_t dim) {
  return {heads * length * dim, length * dim, dim, 1};
}

// Strides of [b, h, s, d] laid out as [b][s][h][d] (a session step's rows).
std::vector<int64_t> RowStrides(int64_t heads, int64_t length, int64_t dim) {
  return {length * heads * dim, dim, heads * dim, 1};
}

struct BuiltGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
  std::string refused;  // why cuDNN would not build it (kept, so it is not tried again)
};

BuiltGraph Build(cudnnHandle_t handle, const CudnnSdpaGraphKey& key) {
  BuiltGraph built;
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(key.fp16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto tensor = [&](const char* name, int64_t uid, int64_t heads, int64_t length, int64_t dim) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_name(name)
                             .set_uid(uid)
                             .set_dim({key.batch, heads, length, dim})
                             .set_stride(DenseStrides(heads, length, dim)));
  };
  auto lengths = [&](const char* name, int64_t uid) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_name(name)
                             .set_uid(uid)
                             .set_dim({key.batch, 1, 1, 1})
                             .set_stride({1, 1, 1, 1})
                             .set_data_type(fe::DataType_t::INT32));
  };
  // A paged graph's keys and values are the pool's blocks: [num_blocks, Hkv, tpb, d] each,
  // a block's values after its keys, and a page table per sequence.
  auto container = [&](const char* name, int64_t uid, int64_t dim) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_name(name)
                             .set_uid(uid)
                             .set_dim({key.num_blocks, key.num_kv_heads, key.tokens_per_block, dim})
                             .set_stride({key.block_elements, key.tokens_per_block * dim, dim, 1}));
  };
  auto page_table = [&](const char* name, int64_t uid) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_name(name)
                             .set_uid(uid)
                             .set_dim({key.batch, 1, key.pages, 1})
                             .set_stride({key.pages, key.pages, 1, 1})
                             .set_data_type(fe::DataType_t::INT32));
  };
  auto q =
      key.paged()
          ? graph->tensor(fe::graph::Tensor_attributes()
                              .set_name("Q")
                              .set_uid(kQ)
                              .set_dim({key.batch, key.num_heads, key.q_bucket, key.head_dim})
                              .set_stride(RowStrides(key.num_heads, key.q_bucket, key.head_dim)))
          : tensor("Q", kQ, key.num_heads, key.q_bucket, key.head_dim);
  auto k = key.paged() ? container("K", kK, key.head_dim)
                       : tensor("K", kK, key.num_kv_heads, key.kv_bucket, key.head_dim);
  auto v = key.paged() ? container("V", kV, key.v_head_dim)
                       : tensor("V", kV, key.num_kv_heads, key.kv_bucket, key.v_head_dim);
  float scale = 0.0f;
  std::memcpy(&scale, &key.scale_bits, sizeof(scale));
  auto options = fe::graph::SDPA_attributes()
                     .set_name("sdpa")
                     .set_generate_stats(false)
                     .set_attn_scale(scale)
                     .set_padding_mask(true)
                     .set_seq_len_q(lengths("q_lengths", kQLengths))
                     .set_seq_len_kv(lengths("kv_lengths", kKvLengths));
  // Bottom-right alignment against the true lengths: query i sees key j iff
  // j <= i + (kv_len - q_len), and with a window, j > i + (kv_len - q_len) - window
  // (core::MaskView's rule).
  if (key.causal) options.set_causal_mask_bottom_right(true);
  if (key.sliding_window > 0) {
    options.set_diagonal_band_left_bound(static_cast<int>(key.sliding_window));
  }
  if (key.paged()) {
    options.set_paged_attention_k_table(page_table("page_table_k", kPageTableK))
        .set_paged_attention_v_table(page_table("page_table_v", kPageTableV))
        .set_paged_attention_max_seq_len_kv(static_cast<int>(key.kv_bucket));
  }
  auto [o, stats] = graph->sdpa(q, k, v, options);
  (void)stats;
  o->set_output(true)
      .set_uid(kO)
      .set_dim({key.batch, key.num_heads, key.q_bucket, key.v_head_dim})
      .set_stride(key.paged() ? RowStrides(key.num_heads, key.q_bucket, key.v_head_dim)
                              : DenseStrides(key.num_heads, key.q_bucket, key.v_head_dim));
  if (fe::error_t status = graph->build(handle, {fe::HeurMode_t::A}); !status.is_good()) {
    built.refused = status.get_message();
    return built;
  }
  if (fe::error_t status = graph->get_workspace_size(built.workspace_bytes); !status.is_good()) {
    built.refused = status.get_message();
    return built;
  }
  built.graph = std::move(graph);
  return built;
}

class Runner final : public CudnnSdpaRunner {
 public:
  explicit Runner(cudnnHandle_t handle) : handle_(handle), graphs_(kCudnnSdpaCachedGraphs) {}
  ~Runner() override { cudnnDestroy(handle_); }

  std::string WorkspaceBytes(const CudnnSdpaGraphKey& key, int64_t* bytes) override {
    BuiltGraph* built = graphs_.Find(key);
    if (built == nullptr) {
      try {
        built = &graphs_.Add(key, Build(handle_, key));
      } catch (const std::exception& error) {  // the frontend throws where cuDNN fails it
        built =
            &graphs_.Add(key, BuiltGraph{nullptr, 0, std::string("cuDNN graph: ") + error.what()});
      }
      // Once per shape bucket while it stays cached: such calls run on the project's kernels.
      if (!built->refused.empty()) {
        std::cerr << "attention-service: cuDNN SDPA refused [B=" << key.batch
                  << " H=" << key.num_heads << " Hkv=" << key.num_kv_heads
                  << " Nq<=" << key.q_bucket << " Nk<=" << key.kv_bucket << " dk=" << key.head_dim
                  << " dv=" << key.v_head_dim << " causal=" << key.causal
                  << " window=" << key.sliding_window << " pages=" << key.pages
                  << "]: " << built->refused.substr(0, 400) << std::endl;
      }
    }
    if (!built->refused.empty()) return built->refused;
    *bytes = built->workspace_bytes;
    return "";
  }

  std::string Run(const CudnnSdpaGraphKey& key, const CudnnSdpaBuffers& buffers, void* workspace,
                  cudaStream_t stream) override {
    BuiltGraph* built = graphs_.Find(key);
    if (built == nullptr || built->graph == nullptr) return "cuDNN graph: not built";
    if (cudnnStatus_t status = cudnnSetStream(handle_, stream); status != CUDNN_STATUS_SUCCESS) {
      return CudnnError("cudnnSetStream", status);
    }
    std::unordered_map<int64_t, void*> pack = {
        {kQ, const_cast<void*>(buffers.query)},
        {kK, const_cast<void*>(buffers.key)},
        {kV, const_cast<void*>(buffers.value)},
        {kO, buffers.output},
        {kQLengths, const_cast<int32_t*>(buffers.q_lengths)},
        {kKvLengths, const_cast<int32_t*>(buffers.kv_lengths)}};
    if (key.paged()) {
      pack[kPageTableK] = const_cast<int32_t*>(buffers.page_table);
      pack[kPageTableV] = const_cast<int32_t*>(buffers.page_table);
    }
    try {
      if (fe::error_t status = built->graph->execute(handle_, pack, workspace); !status.is_good()) {
        return "cuDNN SDPA: " + status.get_message();
      }
    } catch (const std::exception& error) {
      return std::string("cuDNN SDPA: ") + error.what();
    }
    return "";
  }

 private:
  const cudnnHandle_t handle_;
  BoundedGraphCache<BuiltGraph> graphs_;
};

int64_t Version() { return static_cast<int64_t>(cudnnGetVersion()); }

CudnnSdpaRunner* CreateRunner(int device, std::string* error) {
  if (cudaError_t status = cudaSetDevice(device); status != cudaSuccess) {
    *error = std::string("cudaSetDevice: ") + cudaGetErrorString(status);
    return nullptr;
  }
  cudnnHandle_t handle = nullptr;
  if (cudnnStatus_t status = cudnnCreate(&handle); status != CUDNN_STATUS_SUCCESS) {
    *error = CudnnError("cudnnCreate", status);
    return nullptr;
  }
  return new Runner(handle);
}

const CudnnSdpaLibrary kLibrary = {&Version, &CreateRunner};

}  // namespace
}  // namespace attention::core::cuda

extern "C" __attribute__((visibility("default"))) const attention::core::cuda::CudnnSdpaLibrary*
AttentionCudnnSdpa() {
  return &attention::core::cuda::kLibrary;
}

#include "core/cuda/cuda_kv_storage.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/paged_decode.h"
#include "core/cuda/paged_decode_plan.h"
#include "core/status_macros.h"

namespace attention::core::cuda {

using kv_cache::BlockId;
using kv_cache::KvLayout;

absl::StatusOr<std::unique_ptr<kv_cache::KvStorage>> CudaKvStorage::Create(int device,
                                                                           int64_t num_blocks,
                                                                           int64_t block_bytes) {
  std::unique_ptr<CudaKvStorage> storage(new CudaKvStorage(device, num_blocks, block_bytes));
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")")));
  void* blocks = nullptr;
  RETURN_IF_ERROR(CudaStatus(cudaMalloc(&blocks, num_blocks * block_bytes),
                             absl::StrCat("cudaMalloc of the KV cache (", num_blocks, " blocks of ",
                                          block_bytes, " bytes) on cuda:", device)));
  storage->blocks_ = static_cast<char*>(blocks);
  RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&storage->sm_major_, cudaDevAttrComputeCapabilityMajor, device),
      "cudaDeviceGetAttribute(compute capability)"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&storage->stream_, cudaStreamNonBlocking),
                             "cudaStreamCreateWithFlags"));
  return std::unique_ptr<kv_cache::KvStorage>(std::move(storage));
}

CudaKvStorage::CudaKvStorage(int device, int64_t num_blocks, int64_t block_bytes)
    : KvStorage(num_blocks, block_bytes), device_(device), name_(absl::StrCat("cuda:", device)) {}

CudaKvStorage::~CudaKvStorage() {
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (blocks_ != nullptr) cudaFree(blocks_);
}

absl::Status CudaKvStorage::CopyTokens(BlockId block, const KvLayout& layout,
                                       int64_t tokens_per_block, int64_t slot, int64_t tokens,
                                       char* keys, char* values, cudaMemcpyKind kind) const {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  const int64_t element = layout.ElementBytes();
  char* const base = Block(block);
  const int64_t heads = layout.num_kv_heads;
  struct Part {
    char* rows;
    int64_t block_offset, dim;
  };
  for (const Part& part :
       {Part{keys, kv_cache::KeyOffset(layout, tokens_per_block, slot, 0) * element,
             layout.key_dim},
        Part{values, kv_cache::ValueOffset(layout, tokens_per_block, slot, 0) * element,
             layout.value_dim}}) {
    const size_t run = tokens * part.dim * element;                    // one head's slots
    const size_t block_pitch = tokens_per_block * part.dim * element;  // head to head
    char* const in_block = base + part.block_offset;
    const cudaError_t error =
        kind == cudaMemcpyHostToDevice
            ? cudaMemcpy2DAsync(in_block, block_pitch, part.rows, run, run, heads, kind, stream_)
            : cudaMemcpy2DAsync(part.rows, run, in_block, block_pitch, run, heads, kind, stream_);
    RETURN_IF_ERROR(CudaStatus(error, "cudaMemcpy2DAsync of KV tokens"));
  }
  // The rows are the caller's, reused when this returns.
  return CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

absl::Status CudaKvStorage::WriteTokens(BlockId block, const KvLayout& layout,
                                        int64_t tokens_per_block, int64_t slot, int64_t tokens,
                                        const void* keys, const void* values) {
  // cudaMemcpy2DAsync reads host → device rows through a non-const pointer type only.
  return CopyTokens(block, layout, tokens_per_block, slot, tokens,
                    static_cast<char*>(const_cast<void*>(keys)),
                    static_cast<char*>(const_cast<void*>(values)), cudaMemcpyHostToDevice);
}

absl::Status CudaKvStorage::ReadTokens(BlockId block, const KvLayout& layout,
                                       int64_t tokens_per_block, int64_t slot, int64_t tokens,
                                       void* keys, void* values) const {
  return CopyTokens(block, layout, tokens_per_block, slot, tokens, static_cast<char*>(keys),
                    static_cast<char*>(values), cudaMemcpyDeviceToHost);
}

absl::Status CudaKvStorage::ReadBlock(BlockId block, void* bytes) const {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(bytes, Block(block), block_bytes(), cudaMemcpyDeviceToHost, stream_),
      "cudaMemcpyAsync of a KV block to the host"));
  return CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

absl::Status CudaKvStorage::WriteBlock(BlockId block, const void* bytes) {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(Block(block), bytes, block_bytes(), cudaMemcpyHostToDevice, stream_),
      "cudaMemcpyAsync of a KV block to the device"));
  // The bytes are the caller's, reused when this returns.
  return CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

absl::Status CudaKvStorage::CopyBlock(BlockId from, BlockId to) {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(Block(to), Block(from), block_bytes(), cudaMemcpyDeviceToDevice, stream_),
      "cudaMemcpyAsync of a KV block"));
  return CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

absl::Status CudaKvStorage::Poison(BlockId block) {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(Block(block), 0xff, block_bytes(), stream_),
                             "cudaMemsetAsync of a KV block"));
  return CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

absl::Status CudaKvStorage::Attend(const PagedDecodeBatch& batch) {
  PagedDecodeBatch device_batch = batch;
  device_batch.storage = {blocks_, block_bytes(), num_blocks()};
  // Block ids are checked here, while the tables are still host memory.
  RETURN_IF_ERROR(ValidatePagedDecodeBatch(device_batch, /*check_block_ids=*/true));
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  const int64_t dk = batch.layout.key_dim, dv = batch.layout.value_dim, h = batch.num_heads;
  // Forks of one prefix, found while the tables are host memory: their shared splits run once.
  const std::vector<SharedPrefixGroup> shared =
      FindSharedPrefixes(device_batch, kCudaPagedSplitKeys);
  ASSIGN_OR_RETURN(const bool on_cudnn, AttendPagedOnCudnn(device_batch, !shared.empty(), blocks_,
                                                           device_, sm_major_, cudnn_, stream_));
  if (on_cudnn) {
    ++cudnn_steps_;
    return absl::OkStatus();
  }
  ++kernel_steps_;
  // One arena for every sequence's block table, query, output and log-sum-exp: one copy in
  // and one copy out. A group's queries first, one after another in member order (as the
  // kernels read a group's rows).
  struct Offsets {
    int64_t table, query = -1, output, log_sum_exp;
  };
  Arena arena;
  std::vector<Offsets> offsets(batch.sequences.size());
  const auto query_bytes = [&](int64_t b) {
    return batch.sequences[b].num_queries * h * dk * static_cast<int64_t>(sizeof(float));
  };
  for (const SharedPrefixGroup& group : shared) {
    int64_t bytes = 0;
    for (const int64_t b : group.sequences) bytes += query_bytes(b);
    int64_t next = arena.Add(bytes);  // one region: the arena aligns each array it adds
    for (const int64_t b : group.sequences) {
      offsets[b].query = next;
      next += query_bytes(b);
    }
  }
  for (size_t b = 0; b < batch.sequences.size(); ++b) {
    const PagedDecodeSequence& s = batch.sequences[b];
    Offsets& o = offsets[b];
    o.table = arena.Add(static_cast<int64_t>(s.block_table.size() * sizeof(BlockId)));
    if (o.query < 0) o.query = arena.Add(query_bytes(b));
    o.output = arena.Add(s.num_queries * h * dv * static_cast<int64_t>(sizeof(float)));
    o.log_sum_exp = s.log_sum_exp == nullptr
                        ? -1
                        : arena.Add(s.num_queries * h * static_cast<int64_t>(sizeof(float)));
  }
  ASSIGN_OR_RETURN(char* host, host_staging_.Reserve(arena.size()));
  ASSIGN_OR_RETURN(char* device, device_staging_.Reserve(arena.size()));
  std::vector<PagedDecodeSequence> on_device(batch.sequences.size());
  for (size_t b = 0; b < batch.sequences.size(); ++b) {
    const PagedDecodeSequence& s = batch.sequences[b];
    const Offsets& o = offsets[b];
    std::memcpy(host + o.table, s.block_table.data(), s.block_table.size() * sizeof(BlockId));
    std::memcpy(host + o.query, s.query, s.num_queries * h * dk * sizeof(float));
    on_device[b] = s;
    on_device[b].block_table = absl::MakeConstSpan(
        reinterpret_cast<const BlockId*>(device + o.table), s.block_table.size());
    on_device[b].query = reinterpret_cast<const float*>(device + o.query);
    on_device[b].output = reinterpret_cast<float*>(device + o.output);
    on_device[b].log_sum_exp =
        o.log_sum_exp < 0 ? nullptr : reinterpret_cast<float*>(device + o.log_sum_exp);
  }
  device_batch.sequences = on_device;
  RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(device, host, arena.size(), cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync of the step's queries"));
  RETURN_IF_ERROR(PagedDecodeCuda(device_batch, stream_, shared));
  RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(host, device, arena.size(), cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync of the step's outputs"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
  for (size_t b = 0; b < batch.sequences.size(); ++b) {
    const PagedDecodeSequence& s = batch.sequences[b];
    const Offsets& o = offsets[b];
    std::memcpy(s.output, host + o.output, s.num_queries * h * dv * sizeof(float));
    if (s.log_sum_exp != nullptr) {
      std::memcpy(s.log_sum_exp, host + o.log_sum_exp, s.num_queries * h * sizeof(float));
    }
  }
  return absl::OkStatus();
}

std::map<std::string, int64_t> CudaKvStorage::AttendCallsByPath() const {
  return {{"cudnn", cudnn_steps_.load()}, {"kernels", kernel_steps_.load()}};
}

}  // namespace attention::core::cuda

// The other process of the CUDA shared memory tests (kserve_cuda_shared_memory_test.cc), as
// tritonclient's cuda_shared_memory would be: cudaMalloc's `bytes` on GPU 0, fills them from
// stdin, writes the cudaIpcMemHandle_t's bytes to stdout, then waits for one byte on stdin
// and writes the buffer's bytes back to stdout.
//
//   cuda_ipc_exporter <bytes>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

int Fail(const char* what, cudaError_t error) {
  std::fprintf(stderr, "cuda_ipc_exporter: %s: %s\n", what, cudaGetErrorString(error));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: cuda_ipc_exporter <bytes>\n");
    return 2;
  }
  const size_t bytes = std::strtoull(argv[1], nullptr, 10);
  std::string data(bytes, '\0');
  if (std::fread(data.data(), 1, bytes, stdin) != bytes) {
    std::fprintf(stderr, "cuda_ipc_exporter: stdin ended before %zu bytes\n", bytes);
    return 1;
  }
  void* buffer = nullptr;
  if (const cudaError_t error = cudaMalloc(&buffer, bytes); error != cudaSuccess) {
    return Fail("cudaMalloc", error);
  }
  if (const cudaError_t error = cudaMemcpy(buffer, data.data(), bytes, cudaMemcpyHostToDevice);
      error != cudaSuccess) {
    return Fail("cudaMemcpy to the device", error);
  }
  cudaIpcMemHandle_t handle;
  if (const cudaError_t error = cudaIpcGetMemHandle(&handle, buffer); error != cudaSuccess) {
    return Fail("cudaIpcGetMemHandle", error);
  }
  std::fwrite(&handle, 1, sizeof(handle), stdout);
  std::fflush(stdout);
  char go = 0;
  if (std::fread(&go, 1, 1, stdin) != 1) return 1;  // the test ended first
  if (const cudaError_t error = cudaMemcpy(data.data(), buffer, bytes, cudaMemcpyDeviceToHost);
      error != cudaSuccess) {
    return Fail("cudaMemcpy from the device", error);
  }
  std::fwrite(data.data(), 1, bytes, stdout);
  std::fflush(stdout);
  cudaFree(buffer);
  return 0;
}

// cuda_ipc_exporter (tests/server/cuda_ipc_exporter.cc) as a child process with pipes to its
// stdin and stdout and its stderr in a file: the other process that exports a GPU buffer for
// the CUDA shared memory tests and bench/served_overhead, as tritonclient's cuda_shared_memory
// would. Header-only, so that both can start it.
#ifndef ATTENTION_TESTS_SERVER_CUDA_IPC_EXPORTER_PROCESS_H_
#define ATTENTION_TESTS_SERVER_CUDA_IPC_EXPORTER_PROCESS_H_

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "core/cuda/cuda_backend.h"

extern char** environ;

namespace attention::testing {

class CudaIpcExporter {
 public:
  explicit CudaIpcExporter(std::string path) : path_(std::move(path)) {}
  CudaIpcExporter(const CudaIpcExporter&) = delete;
  CudaIpcExporter& operator=(const CudaIpcExporter&) = delete;
  ~CudaIpcExporter() {
    if (in_ >= 0) close(in_);
    if (out_ >= 0) close(out_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
    unlink(errors_.c_str());
  }

  // cuda_ipc_exporter beside the running binary, as CMake and scripts/gpu-bundle place it.
  static std::string BesideThisBinary() {
    char self[4096] = {};
    const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
    const std::string binary(self, length > 0 ? length : 0);
    return binary.substr(0, binary.rfind('/') + 1) + "cuda_ipc_exporter";
  }

  const std::string& path() const { return path_; }
  bool found() const { return access(path_.c_str(), X_OK) == 0; }

  // Starts it over `contents`; false (with the reason in `failure`) when it cannot export
  // them, as on a machine without a GPU.
  bool Start(const std::string& contents, std::string* handle, std::string* failure) {
    std::signal(SIGPIPE, SIG_IGN);  // a child that died fails the write instead
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) return false;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    posix_spawn_file_actions_addopen(&actions, 2, errors_.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0600);
    posix_spawn_file_actions_addclose(&actions, to_child[1]);
    posix_spawn_file_actions_addclose(&actions, from_child[0]);
    const std::string size = std::to_string(contents.size());
    char* argv[] = {path_.data(), const_cast<char*>(size.c_str()), nullptr};
    const int spawned = posix_spawn(&pid_, path_.c_str(), &actions, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    close(to_child[0]);
    close(from_child[1]);
    in_ = to_child[1];
    out_ = from_child[0];
    if (spawned != 0) {
      *failure = "posix_spawn: " + std::string(std::strerror(spawned));
      return false;
    }
    if (!WriteAll(contents) || !ReadAll(core::kCudaIpcHandleBytes, handle)) {
      *failure = Errors();
      return false;
    }
    return true;
  }
  // Its buffer's first `bytes` bytes now; false when it cannot say (see Errors).
  bool Dump(size_t bytes, std::string* contents) {
    return WriteAll("g") && ReadAll(bytes, contents);
  }
  // What it wrote to stderr.
  std::string Errors() const {
    std::ifstream file(errors_);
    std::stringstream text;
    text << file.rdbuf();
    return text.str();
  }

 private:
  bool WriteAll(const std::string& bytes) {
    for (size_t done = 0; done < bytes.size();) {
      const ssize_t put = write(in_, bytes.data() + done, bytes.size() - done);
      if (put <= 0) return false;
      done += static_cast<size_t>(put);
    }
    return true;
  }
  bool ReadAll(size_t bytes, std::string* into) {
    into->resize(bytes);
    for (size_t done = 0; done < bytes;) {
      const ssize_t got = read(out_, into->data() + done, bytes - done);
      if (got <= 0) return false;
      done += static_cast<size_t>(got);
    }
    return true;
  }

  std::string path_;
  const std::string errors_ = "/tmp/cuda_ipc_exporter." + std::to_string(getpid()) + ".err";
  pid_t pid_ = -1;
  int in_ = -1, out_ = -1;
};

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SERVER_CUDA_IPC_EXPORTER_PROCESS_H_

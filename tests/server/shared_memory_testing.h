// What the KServe shared memory tests share: a POSIX shared memory object as a caller's would
// be, a system region's registration, and the check of a refusal's status and message.
#ifndef ATTENTION_TESTS_SERVER_SHARED_MEMORY_TESTING_H_
#define ATTENTION_TESTS_SERVER_SHARED_MEMORY_TESTING_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.pb.h"

namespace attention::server::testing {

// A POSIX shared memory object of `bytes`, unlinked when it goes.
class SharedObject {
 public:
  explicit SharedObject(uint64_t bytes)
      : key_("/attention-test-" + std::to_string(getpid()) + "-" + std::to_string(count_++)) {
    const int fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << key_ << ": " << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
    fd_ = fd;
  }
  ~SharedObject() {
    close(fd_);
    shm_unlink(key_.c_str());
  }
  const std::string& key() const { return key_; }
  void Write(uint64_t offset, const std::string& bytes) const {
    ASSERT_EQ(pwrite(fd_, bytes.data(), bytes.size(), static_cast<off_t>(offset)),
              static_cast<ssize_t>(bytes.size()));
  }
  std::string Read(uint64_t offset, uint64_t size) const {
    std::string bytes(size, '\0');
    EXPECT_EQ(pread(fd_, bytes.data(), size, static_cast<off_t>(offset)),
              static_cast<ssize_t>(size));
    return bytes;
  }
  void Resize(uint64_t bytes) const { ASSERT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0); }

 private:
  static inline int count_ = 0;
  std::string key_;
  int fd_ = -1;
};

inline inference::SystemSharedMemoryRegisterRequest Registration(const std::string& name,
                                                                 const std::string& key,
                                                                 uint64_t offset,
                                                                 uint64_t byte_size) {
  inference::SystemSharedMemoryRegisterRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  return request;
}

// `status` has `code` and a message holding `part`, bounded in length.
inline void ExpectStatus(const absl::Status& status, absl::StatusCode code,
                         const std::string& part) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_NE(status.message().find(part), std::string::npos) << status.message();
  EXPECT_LE(status.message().size(), 1024u);
}

}  // namespace attention::server::testing

#endif  // ATTENTION_TESTS_SERVER_SHARED_MEMORY_TESTING_H_

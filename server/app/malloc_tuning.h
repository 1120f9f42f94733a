// Process-wide malloc settings for a server that moves messages of many megabytes.
#ifndef ATTENTION_SERVER_APP_MALLOC_TUNING_H_
#define ATTENTION_SERVER_APP_MALLOC_TUNING_H_

#include <cstddef>

namespace attention::server {

// Keeps freed message buffers (up to 32 MiB each) in the heap for the next request, holding
// at most `retained_bytes` free in a heap before returning memory to the system. By default
// glibc returns a heap's free top once it passes twice the largest freed buffer, so each
// large request met freshly mapped pages and paid their page faults again: protobuf parsing
// and serializing a 12.6 MB request and its answer took 33 ms instead of 7 ms
// (bench/served_overhead). Does nothing when GLIBC_TUNABLES is set: an operator's malloc
// settings win.
void KeepLargeBuffersInHeap(size_t retained_bytes);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_APP_MALLOC_TUNING_H_

// ATTENTION_HOST_DEVICE marks functions compiled for the host and, under nvcc, for CUDA
// devices too (see core/attention_math.h).
#ifndef ATTENTION_CORE_HOST_DEVICE_H_
#define ATTENTION_CORE_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define ATTENTION_HOST_DEVICE __host__ __device__
#else
#define ATTENTION_HOST_DEVICE
#endif

#endif  // ATTENTION_CORE_HOST_DEVICE_H_

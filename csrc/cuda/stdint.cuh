// Fixed-width integer types for the torch-free CUDA headers, under nvcc and under NVRTC (which ships no C
// library headers: specadapt.cuda_jit compiles these headers at run time with CuPy).
#pragma once

#if defined(__CUDACC_RTC__)
typedef long long int64_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
#else
#include <stdint.h>
#endif

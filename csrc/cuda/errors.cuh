// Error bits the torch-free CUDA kernels OR into their int32 error flag (no host synchronisation on the device
// path: a kernel cannot raise, so it records what went wrong and writes -1 where a token could not be drawn).
// The flag is owned by the caller (specadapt.kernel_errors, one int32 per op and device) and read on demand, at a
// sync point the caller already has, or after every launch in debug mode (SPECADAPT_DEBUG_KERNELS=1); the Python
// decoder (specadapt.kernel_errors.ERROR_BITS) mirrors these constants and tests/test_kernel_errors.py checks it.
// The CPU kernels raise the same conditions directly.
#pragma once

#include "stdint.cuh"

namespace specadapt {
namespace cuda {

// The target row of the extra token has no mass: nothing can be sampled (extra token -1).
constexpr int32_t kErrorNoTargetMass = 1;
// GBV walk: a drafted token has draft probability 0 (it cannot be a sample from q).
constexpr int32_t kErrorZeroDraftProb = 2;
// A row of target_probs or draft_probs the output depends on does not sum to 1 (row_sum_tolerance; extra -1).
constexpr int32_t kErrorRowSum = 4;

// OR `bits` into the flag (null: the caller does not collect errors).
__device__ __forceinline__ void report_error(int32_t* error, int32_t bits) {
  if (error != nullptr) atomicOr(error, bits);
}

}  // namespace cuda
}  // namespace specadapt

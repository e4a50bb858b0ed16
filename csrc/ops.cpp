// Operator schemas of the specadapt extension (specadapt._C).
// Implementations register per dispatch key in csrc/cpu and csrc/cuda; fake (meta) implementations for
// torch.compile / opcheck live in python/specadapt/kernels.py.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Importing specadapt._C only has to run the static registrations below; the module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(specadapt, m) {
  // Block-verification residual reduction (docs/design/specs/verification.md section 2):
  //   Z[n] = sum_v max(weights[n] * target_probs[n, v] - draft_probs[n, v], 0)
  // target_probs, draft_probs: [N, V] float32 or bfloat16 (same dtype); weights: [N] float32 -> [N] float32.
  m.def("block_residual_mass(Tensor target_probs, Tensor draft_probs, Tensor weights) -> Tensor");
  // Single-path verification rules (docs/design/specs/verification.md sections 1, 2 and 4). candidates [B, L+1] int64,
  // target_probs [B, L+1, V] and draft_probs [B, L, V] float32/bfloat16, uniforms [B, L], uniforms_final [B],
  // optional num_draft_tokens [B] -> (accept_len [B] int32, output_tokens [B, L+1] int32, padded with -1).
  // error: optional [>= 1] int32 flag the CUDA kernels OR their error bits into (csrc/cuda/errors.cuh; read by
  // specadapt.kernel_errors, no host sync); the CPU kernels raise those conditions directly and ignore it.
  m.def("chain_verify(Tensor candidates, Tensor target_probs, Tensor draft_probs, Tensor uniforms, "
        "Tensor uniforms_final, Tensor? num_draft_tokens=None, Tensor(a!)? error=None) -> (Tensor, Tensor)");
  m.def("block_verify(Tensor candidates, Tensor target_probs, Tensor draft_probs, Tensor uniforms, "
        "Tensor uniforms_final, Tensor? num_draft_tokens=None, Tensor(a!)? error=None) -> (Tensor, Tensor)");
  // Greedy multi-path block verification (section 3): candidates [B, K, L+1], target_probs [B, K, L+1, V],
  // draft_probs [B, K, L, V], uniforms [B, L], uniforms_final [B]
  // -> (accept_len [B] int32, output_tokens [B, L+1] int32, chosen_path [B] int32).
  // IRLS statistics of the acceptance estimator (docs/design/specs/adaptive_verification.md section 4): features [B, K],
  // predictions [B, K], accepted [B], verified [B] -> [K, 6] float64 (a, b, c, g0, g1, n).
  m.def("irls_accumulate(Tensor features, Tensor predictions, Tensor accepted, Tensor verified) -> Tensor");
  // error: as for chain_verify.
  m.def("gbv_verify(Tensor candidates, Tensor target_probs, Tensor draft_probs, Tensor uniforms, "
        "Tensor uniforms_final, Tensor(a!)? error=None) -> (Tensor, Tensor, Tensor)");
}

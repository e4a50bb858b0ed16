// CPU implementation of specadapt::irls_accumulate (docs/design/specs/adaptive_verification.md section 4): one pass over the
// batch's [B, K] features and predictions and [B] outcomes, producing the [K, 6] IRLS statistics
// (a, b, c, g0, g1, n) in double. Labels: positions up to and including the first rejection. Non-finite
// features or predictions are skipped, so NaN never reaches the coefficients.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "../common/irls_checks.h"

namespace specadapt {
namespace cpu {
namespace {

at::Tensor irls_accumulate_cpu(const at::Tensor& features, const at::Tensor& predictions, const at::Tensor& accepted,
                               const at::Tensor& verified) {
  check_irls_args(features, predictions, accepted, verified);
  const int64_t B = features.size(0), K = features.size(1);
  const auto f = features.to(at::kDouble).contiguous();
  const auto p = predictions.to(at::kDouble).contiguous();
  const auto acc = accepted.to(at::kLong).contiguous();
  const auto ver = verified.to(at::kLong).contiguous();
  auto out = at::zeros({K, 6}, features.options().dtype(at::kDouble));
  const double* fp = f.data_ptr<double>();
  const double* pp = p.data_ptr<double>();
  const int64_t* ap = acc.data_ptr<int64_t>();
  const int64_t* vp = ver.data_ptr<int64_t>();
  double* o = out.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t last = std::min(vp[b] - 1, ap[b]);  // labelled positions: k < verified and k <= accepted
    for (int64_t k = 0; k <= last && k < K; ++k) {
      const double fk = fp[b * K + k], pk = pp[b * K + k];
      if (!std::isfinite(fk) || !std::isfinite(pk)) continue;
      const double y = k < ap[b] ? 1.0 : 0.0;
      const double r = y - pk, w = pk * (1.0 - pk);
      double* row = o + k * 6;
      row[0] += w * fk * fk;
      row[1] += w * fk;
      row[2] += w;
      row[3] += r * fk;
      row[4] += r;
      row[5] += 1.0;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specadapt, CPU, m) { m.impl("irls_accumulate", &irls_accumulate_cpu); }

}  // namespace cpu
}  // namespace specadapt

// fedflat's fused vector passes for FedWMSAM's step (fedflat/algorithms/fedwmsam.py), with ATen's roundings.
//
// guided_point: the momentum-guided perturbed point in two passes over the flat vector instead of five ATen calls.
// The ATen expression it replaces, per row of W[C, P] (MomentumGuidedPerturbation.perturb, then the loop's w + eps):
//     d = torch.sub(w_start, W).add_(m, alpha=alpha)      # (w^t - w_k) + k m_i
//     s = radius / (vector_norm(d, dim=-1) + 1e-12)       # Tensor.__rtruediv__: reciprocal(n + 1e-12) * radius
//     point = W + d * s
// Pass 1 writes d into the point's buffer and accumulates its squared norm; pass 2 turns it into the point in place
// (no buffer for d; writing d costs less than computing it again from three vectors).
// mix_norm: the momentum mix g.lerp_(m, 1 - a) in place and vector_norm of its rows, returned, in one pass (the
// engine's loss-scope clip takes the norms: fedflat.core.MeasuredDirection).
//
// Each value is rounded as torch's CPU kernels round it (AVX2 and FMA, or AVX512: checked, see below):
// - sub: ws - W (one rounding); add_ with alpha: fma(m, alpha, ws - W), as the ufunc's vectorized add (vec::fmadd)
//   and its contracted scalar remainder compute it;
// - lerp (weight w, a float32 number): fma(w, m - g, g) where |w| < 0.5, else fma(w - 1, m - g, m), as its
//   vectorized kernel (blendv, fmadd) and its scalar one (contracted) compute it;
// - vector_norm (linalg_vector_norm's reduce-last-dim kernel for float, ord 2): `lanes` float accumulators (8 on
//   torch 2.13's AVX512 build as on AVX2) over the row's whole runs of `lanes` entries in order, acc + x * x (the
//   product rounded, then the sum), then the accumulators summed left to right; the remainder as that build's
//   compiled scalar loop adds it: runs of 4 products rounded and added in order, the last 0-3 terms with fma; sqrtf;
// - the scale s: float n + 1e-12f, 1.0f / it, times float(radius), each rounded; the point fl(W + fl(d s)).
// Where torch's kernels round otherwise (another build, another CPU) the results differ in last bits: so FedWMSAM
// uses an operator only after it reproduced the ATen expression bit for bit on a probe of every remainder
// (fedflat.algorithms.fedwmsam.fused_guided_point, fused_mix_norm), and runs the ATen expression where it did not.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace {

#define FEDFLAT_AVX2 __attribute__((target("avx2,fma")))

// ATen's ord-2 vector_norm of a row from its `lanes` accumulators after the whole runs (the first `done` entries of
// d): the accumulators summed left to right, then the remainder as torch's build compiled ATen's scalar loop
// `sum += x * x` (its vectorized in-order reduction: runs of 4 products rounded, then added in order; the last 0-3
// terms contracted to fma), then sqrtf
FEDFLAT_AVX2 float finish_norm(__m256 low, __m256 high, const float* __restrict d, int64_t done, int64_t n,
                               int64_t lanes) {
  alignas(32) float buffer[16];
  _mm256_store_ps(buffer, low);
  _mm256_store_ps(buffer + 8, high);
  float total = buffer[0];
  for (int64_t l = 1; l < lanes; ++l) total = total + buffer[l];
  int64_t j = done;
  for (; j + 4 <= n; j += 4) {
    for (int64_t i = j; i < j + 4; ++i) {
      const float square = d[i] * d[i];
      total = total + square;
    }
  }
  for (; j < n; ++j) total = std::fma(d[j], d[j], total);
  return std::sqrt(total);
}

// d's 8 entries from i on: fma(m, alpha, ws - W), as ATen's sub then add_(m, alpha) round them
FEDFLAT_AVX2 inline __m256 direction8(const float* ws, const float* w, const float* m, __m256 alpha, int64_t i) {
  return _mm256_fmadd_ps(_mm256_loadu_ps(m + i), alpha, _mm256_sub_ps(_mm256_loadu_ps(ws + i), _mm256_loadu_ps(w + i)));
}

// pass 1 over one row: d = fma(m, alpha, ws - W), written to d; returns the norm of d as ATen's kernel rounds it with
// `lanes` (8 or 16) accumulators: 8-float registers, `lanes / 8` of them over each run of `lanes` entries
template <int64_t lanes>
FEDFLAT_AVX2 float direction_norm(const float* __restrict ws, const float* __restrict w, const float* __restrict m,
                                  float alpha, float* __restrict d, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();  // the accumulators of lanes 0-7 and 8-15
  int64_t j = 0;
  for (; j + lanes <= n; j += lanes) {
    const __m256 v = direction8(ws, w, m, a, j);
    _mm256_storeu_ps(d + j, v);
    low = _mm256_add_ps(low, _mm256_mul_ps(v, v));
    if constexpr (lanes == 16) {
      const __m256 u = direction8(ws, w, m, a, j + 8);
      _mm256_storeu_ps(d + j + 8, u);
      high = _mm256_add_ps(high, _mm256_mul_ps(u, u));
    }
  }
  for (int64_t i = j; i < n; ++i) d[i] = std::fma(m[i], alpha, ws[i] - w[i]);
  return finish_norm(low, high, d, j, n, lanes);
}

// pass 2 over one row: point = W + d s (the product rounded, then the sum), d read from `point` where pass 1 left it
FEDFLAT_AVX2 void shifted(const float* __restrict w, float s, float* __restrict point, int64_t n) {
  const __m256 scale = _mm256_set1_ps(s);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(point + j, _mm256_add_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(point + j), scale)));
  }
  for (; j < n; ++j) {
    const float eps = point[j] * s;
    point[j] = w[j] + eps;
  }
}

// one row of grad.lerp_(m, weight) in place, as ATen's lerp rounds it (|w| < 0.5: fma(w, m - g, g); else
// fma(w - 1, m - g, m)), and the result's norm as vector_norm rounds it
template <int64_t lanes>
FEDFLAT_AVX2 float mixed_norm(float* __restrict g, const float* __restrict m, float weight, int64_t n) {
  const bool small = std::fabs(weight) < 0.5f;
  const __m256 coeff = _mm256_set1_ps(small ? weight : weight - 1.0f);
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + lanes <= n; j += lanes) {
    for (int64_t r = 0; r < lanes / 8; ++r) {
      const __m256 gv = _mm256_loadu_ps(g + j + 8 * r), mv = _mm256_loadu_ps(m + j + 8 * r);
      const __m256 v = _mm256_fmadd_ps(coeff, _mm256_sub_ps(mv, gv), small ? gv : mv);
      _mm256_storeu_ps(g + j + 8 * r, v);
      if (r == 0) {
        low = _mm256_add_ps(low, _mm256_mul_ps(v, v));
      } else {
        high = _mm256_add_ps(high, _mm256_mul_ps(v, v));
      }
    }
  }
  for (int64_t i = j; i < n; ++i) {
    g[i] = small ? std::fma(weight, m[i] - g[i], g[i]) : std::fma(weight - 1.0f, m[i] - g[i], m[i]);
  }
  return finish_norm(low, high, g, j, n, lanes);
}

// a [C, P] or [P] operand's row c: its base plus c times its row stride (0 for a [P] vector or an expanded row)
const float* row(const at::Tensor& t, int64_t c) {
  const int64_t stride = t.dim() == 2 ? t.stride(0) : 0;
  return t.const_data_ptr<float>() + c * stride;
}

// What both operators need of the machine and of their lanes (the norm's accumulators).
void check_kernel(const char* op, int64_t lanes) {
  TORCH_CHECK(lanes == 8 || lanes == 16, "fedflat::", op, ": lanes (the norm's accumulators) is 8 or 16");
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
              "fedflat::", op, ": this CPU has no AVX2 and FMA (the ATen expression runs instead)");
}

// An operand of C rows of P, or one row [P] shared by every row.
void check(const at::Tensor& t, const char* op, const char* name, int64_t C, int64_t P) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && (t.dim() == 1 || t.dim() == 2) &&
                  t.size(-1) == P && t.stride(-1) == 1,
              "fedflat::", op, ": ", name, " must be a float32 CPU [C, P] or [P] tensor with unit last stride");
  TORCH_CHECK(t.dim() == 1 || t.size(0) == C, "fedflat::", op, ": ", name, " has C rows or is [P]");
}

void guided_point(const at::Tensor& w_start, const at::Tensor& W, const at::Tensor& m, double alpha, double radius,
                  int64_t lanes, at::Tensor point) {
  TORCH_CHECK(W.dim() == 2 && W.is_contiguous() && point.is_contiguous() && point.sizes() == W.sizes(),
              "fedflat::guided_point: W and point must be contiguous tensors of one [C, P] shape");
  check_kernel("guided_point", lanes);
  const int64_t C = W.size(0), P = W.size(1);
  check(w_start, "guided_point", "w_start", C, P);
  check(m, "guided_point", "m", C, P);
  check(point, "guided_point", "point", C, P);
  const float a = static_cast<float>(alpha), r = static_cast<float>(radius), tiny = static_cast<float>(1e-12);
  for (int64_t c = 0; c < C; ++c) {
    const float *w = W.const_data_ptr<float>() + c * P, *ws = row(w_start, c), *mc = row(m, c);
    float* pc = point.data_ptr<float>() + c * P;
    const float norm = lanes == 8 ? direction_norm<8>(ws, w, mc, a, pc, P) : direction_norm<16>(ws, w, mc, a, pc, P);
    shifted(w, (1.0f / (norm + tiny)) * r, pc, P);
  }
}

at::Tensor mix_norm(at::Tensor g, const at::Tensor& m, const at::Tensor& weight, int64_t lanes) {
  TORCH_CHECK(g.dim() == 2 && g.is_contiguous() && g.device().is_cpu() && g.scalar_type() == at::kFloat,
              "fedflat::mix_norm: g must be a contiguous float32 CPU [C, P] tensor");
  TORCH_CHECK(weight.numel() == 1 && weight.device().is_cpu() && weight.scalar_type() == at::kFloat,
              "fedflat::mix_norm: weight must be one float32 CPU number");
  check_kernel("mix_norm", lanes);
  const int64_t C = g.size(0), P = g.size(1);
  check(m, "mix_norm", "m", C, P);
  const float w = weight.item<float>();
  at::Tensor norms = at::empty({C, 1}, g.options());
  for (int64_t c = 0; c < C; ++c) {
    float* gc = g.data_ptr<float>() + c * P;
    norms.data_ptr<float>()[c] = lanes == 8 ? mixed_norm<8>(gc, row(m, c), w, P) : mixed_norm<16>(gc, row(m, c), w, P);
  }
  return norms;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedflat, m) {
  m.def("mix_norm(Tensor(a!) g, Tensor m, Tensor weight, int lanes) -> Tensor", &mix_norm);
  m.def("guided_point(Tensor w_start, Tensor W, Tensor m, float alpha, float radius, int lanes, Tensor(a!) point) -> ()",
        &guided_point);
}

// fedflat's fused vector passes for the SAM family's local steps (fedflat/algorithms: fedwmsam.py, fedcm.py,
// fedsam.py; the loop's sum, fedflat/core/part.py), each with a rounding of its own: the same bits on every CPU.
//
// guided_point: the momentum-guided perturbed point in two passes over the flat vector instead of five ATen calls.
// The expression it computes, per row of W[C, P] (MomentumGuidedPerturbation.perturb, then the loop's w + eps):
//     d = (w_start - W) + alpha m                         # (w^t - w_k) + k m_i
//     s = radius / (||d|| + 1e-12)
//     point = W + d * s
// Pass 1 writes d into the point's buffer and accumulates its squared norm; pass 2 turns it into the point in place
// (no buffer for d; writing d costs less than computing it again from three vectors).
// mix_norm: the momentum mix g.lerp_(m, weight) in place and the norm of each row of the result, returned, in one
// pass (the engine's loss-scope clip takes the norms: fedflat.core.MeasuredDirection).
// sam_point: SAM's perturbed point (fedflat/algorithms/fedsam.py, LocalSAM.perturbed_point) from the ascent u and
// d = ||u|| + 1e-12, which ATen computes: point = W + (u r) / d in one pass instead of three (mul_, div_ and the
// loop's sum), each operation rounded once as ATen's kernels round it on every dispatch level (no fma): the torch
// expressions' bits on every CPU.
// point_sum: W + eps (the local loop's perturbed point) into the loop's buffer: one rounded sum, the same bits on every
// CPU and level; at ATen's default level, whose add runs a scalar loop, about 3x faster.
//
// The rounding, defined here (every operation in float32, round to nearest even; fma: one rounding):
// - d_j = fma(m_j, alpha, ws_j - W_j);
// - lerp (weight w): fma(w, m_j - g_j, g_j) where |w| < 0.5, else fma(w - 1, m_j - g_j, m_j);
// - the squared norm: 8 accumulators, a_l <- a_l + x_j * x_j (the product rounded, then the sum) for j = 8 i + l over
//   the row's whole runs of 8 entries in order; then a_0 + a_1 + ... + a_7 left to right; then the remaining 0-7
//   entries: runs of 4 added as rounded products in order, the last 0-3 with fma(x_j, x_j, total); the norm sqrtf;
// - s = (1 / (n + 1e-12)) * radius, each rounded; point_j = W_j + d_j * s (the product rounded, then the sum).
// Two loops compute it: AVX2 and FMA registers where the CPU has them, plain scalar loops (std::fma) everywhere
// else or when `scalar` is set; tests/test_native_vector_ops.py checks both against an exact reference.
// This is ATen's order for these expressions in torch 2.13's AVX2 kernels, which its AVX-512 build also runs for them
// (the ord-2 vector_norm's reduce-last-dim kernel, the ufuncs' vec::fmadd, lerp's blendv and fmadd, the scalar
// remainders as GCC compiled them): there FedWMSAM's torch expressions give these bits too. ATen's default build
// (ATEN_CPU_CAPABILITY=default) rounds them otherwise (no fma, another remainder), so FedWMSAM's numbers are those
// of these kernels wherever they are built, and the torch expressions' where they are not (docs/architecture.md,
// "Exactness").
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FEDFLAT_X86 1
#define FEDFLAT_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace {

constexpr int64_t kLanes = 8;  // the norm's accumulators

// The squared norm's end (the rounding above): the accumulators summed left to right, then the row's remaining
// `count` (0-7) entries `rest` (runs of 4 rounded products added in order, the last 0-3 with fma), then sqrtf.
float finish_norm(const float* acc, const float* __restrict rest, int64_t count) {
  float total = acc[0];
  for (int64_t l = 1; l < kLanes; ++l) total = total + acc[l];
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    for (int64_t i = j; i < j + 4; ++i) {
      const float square = rest[i] * rest[i];
      total = total + square;
    }
  }
  for (; j < count; ++j) total = std::fma(rest[j], rest[j], total);
  return std::sqrt(total);
}

// ---- the scalar loops: every CPU

float direction_norm_scalar(const float* __restrict ws, const float* __restrict w, const float* __restrict m,
                            float alpha, float* __restrict d, int64_t n) {
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = std::fma(m[j + l], alpha, ws[j + l] - w[j + l]);
      d[j + l] = v;
      const float square = v * v;
      acc[l] = acc[l] + square;
    }
  }
  for (int64_t i = j; i < n; ++i) d[i] = std::fma(m[i], alpha, ws[i] - w[i]);
  return finish_norm(acc, d + j, n - j);
}

void shifted_scalar(const float* __restrict w, float s, float* __restrict point, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float eps = point[j] * s;
    point[j] = w[j] + eps;
  }
}

float mixed_norm_scalar(float* __restrict g, const float* __restrict m, float weight, int64_t n) {
  const bool small = std::fabs(weight) < 0.5f;
  const float coeff = small ? weight : weight - 1.0f;
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = std::fma(coeff, m[j + l] - g[j + l], small ? g[j + l] : m[j + l]);
      g[j + l] = v;
      const float square = v * v;
      acc[l] = acc[l] + square;
    }
  }
  for (int64_t i = j; i < n; ++i) g[i] = std::fma(coeff, m[i] - g[i], small ? g[i] : m[i]);
  return finish_norm(acc, g + j, n - j);
}

// point = W + (u r) / d, the product, the quotient and the sum each rounded (mul_, div_, the loop's add)
void sam_shift_scalar(const float* __restrict u, const float* __restrict w, float r, float d, float* __restrict point,
                      int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float scaled = u[j] * r;
    const float eps = scaled / d;
    point[j] = w[j] + eps;
  }
}

// out = W + eps, one rounded sum
void sum_scalar(const float* __restrict w, const float* __restrict eps, float* __restrict out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = w[j] + eps[j];
}

// ---- the same operations in AVX2 and FMA registers

#ifdef FEDFLAT_X86
FEDFLAT_AVX2 float direction_norm_avx2(const float* __restrict ws, const float* __restrict w,
                                       const float* __restrict m, float alpha, float* __restrict d, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(m + j), a,
                                     _mm256_sub_ps(_mm256_loadu_ps(ws + j), _mm256_loadu_ps(w + j)));
    _mm256_storeu_ps(d + j, v);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  for (int64_t i = j; i < n; ++i) d[i] = std::fma(m[i], alpha, ws[i] - w[i]);
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, acc);
  return finish_norm(lanes, d + j, n - j);
}

FEDFLAT_AVX2 void shifted_avx2(const float* __restrict w, float s, float* __restrict point, int64_t n) {
  const __m256 scale = _mm256_set1_ps(s);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    _mm256_storeu_ps(point + j, _mm256_add_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(point + j), scale)));
  }
  for (; j < n; ++j) {
    const float eps = point[j] * s;
    point[j] = w[j] + eps;
  }
}

FEDFLAT_AVX2 float mixed_norm_avx2(float* __restrict g, const float* __restrict m, float weight, int64_t n) {
  const bool small = std::fabs(weight) < 0.5f;
  const float coefficient = small ? weight : weight - 1.0f;
  const __m256 coeff = _mm256_set1_ps(coefficient);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const __m256 gv = _mm256_loadu_ps(g + j), mv = _mm256_loadu_ps(m + j);
    const __m256 v = _mm256_fmadd_ps(coeff, _mm256_sub_ps(mv, gv), small ? gv : mv);
    _mm256_storeu_ps(g + j, v);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  for (int64_t i = j; i < n; ++i) g[i] = std::fma(coefficient, m[i] - g[i], small ? g[i] : m[i]);
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, acc);
  return finish_norm(lanes, g + j, n - j);
}

FEDFLAT_AVX2 void sam_shift_avx2(const float* __restrict u, const float* __restrict w, float r, float d,
                                 float* __restrict point, int64_t n) {
  const __m256 rv = _mm256_set1_ps(r), dv = _mm256_set1_ps(d);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const __m256 eps = _mm256_div_ps(_mm256_mul_ps(_mm256_loadu_ps(u + j), rv), dv);
    _mm256_storeu_ps(point + j, _mm256_add_ps(_mm256_loadu_ps(w + j), eps));
  }
  sam_shift_scalar(u + j, w + j, r, d, point + j, n - j);
}

FEDFLAT_AVX2 void sum_avx2(const float* __restrict w, const float* __restrict eps, float* __restrict out, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(eps + j)));
  }
  sum_scalar(w + j, eps + j, out + j, n - j);
}
#endif

// Whether the AVX2 loops run: an x86 CPU with AVX2 and FMA, unless the caller asks for the scalar loops.
bool vectorized(bool scalar) {
#ifdef FEDFLAT_X86
  return !scalar && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

float direction_norm(bool avx2, const float* ws, const float* w, const float* m, float alpha, float* d, int64_t n) {
#ifdef FEDFLAT_X86
  if (avx2) return direction_norm_avx2(ws, w, m, alpha, d, n);
#endif
  return direction_norm_scalar(ws, w, m, alpha, d, n);
}

void shifted(bool avx2, const float* w, float s, float* point, int64_t n) {
#ifdef FEDFLAT_X86
  if (avx2) return shifted_avx2(w, s, point, n);
#endif
  shifted_scalar(w, s, point, n);
}

float mixed_norm(bool avx2, float* g, const float* m, float weight, int64_t n) {
#ifdef FEDFLAT_X86
  if (avx2) return mixed_norm_avx2(g, m, weight, n);
#endif
  return mixed_norm_scalar(g, m, weight, n);
}

void sam_shift(bool avx2, const float* u, const float* w, float r, float d, float* point, int64_t n) {
#ifdef FEDFLAT_X86
  if (avx2) return sam_shift_avx2(u, w, r, d, point, n);
#endif
  sam_shift_scalar(u, w, r, d, point, n);
}

// a [C, P] or [P] operand's row c: its base plus c times its row stride (0 for a [P] vector or an expanded row)
const float* row(const at::Tensor& t, int64_t c) {
  const int64_t stride = t.dim() == 2 ? t.stride(0) : 0;
  return t.const_data_ptr<float>() + c * stride;
}

// An operand of C rows of P, or one row [P] shared by every row.
void check(const at::Tensor& t, const char* op, const char* name, int64_t C, int64_t P) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && (t.dim() == 1 || t.dim() == 2) &&
                  t.size(-1) == P && t.stride(-1) == 1,
              "fedflat::", op, ": ", name, " must be a float32 CPU [C, P] or [P] tensor with unit last stride");
  TORCH_CHECK(t.dim() == 1 || t.size(0) == C, "fedflat::", op, ": ", name, " has C rows or is [P]");
}

void guided_point(const at::Tensor& w_start, const at::Tensor& W, const at::Tensor& m, double alpha, double radius,
                  at::Tensor point, bool scalar) {
  TORCH_CHECK(W.dim() == 2 && W.is_contiguous() && point.is_contiguous() && point.sizes() == W.sizes(),
              "fedflat::guided_point: W and point must be contiguous tensors of one [C, P] shape");
  const int64_t C = W.size(0), P = W.size(1);
  check(W, "guided_point", "W", C, P);
  check(w_start, "guided_point", "w_start", C, P);
  check(m, "guided_point", "m", C, P);
  check(point, "guided_point", "point", C, P);
  const bool avx2 = vectorized(scalar);
  const float a = static_cast<float>(alpha), r = static_cast<float>(radius), tiny = static_cast<float>(1e-12);
  for (int64_t c = 0; c < C; ++c) {
    const float *w = W.const_data_ptr<float>() + c * P;
    float* pc = point.data_ptr<float>() + c * P;
    const float norm = direction_norm(avx2, row(w_start, c), w, row(m, c), a, pc, P);
    shifted(avx2, w, (1.0f / (norm + tiny)) * r, pc, P);
  }
}

at::Tensor mix_norm(at::Tensor g, const at::Tensor& m, const at::Tensor& weight, bool scalar) {
  TORCH_CHECK(g.dim() == 2 && g.is_contiguous() && g.device().is_cpu() && g.scalar_type() == at::kFloat,
              "fedflat::mix_norm: g must be a contiguous float32 CPU [C, P] tensor");
  TORCH_CHECK(weight.numel() == 1 && weight.device().is_cpu() && weight.scalar_type() == at::kFloat,
              "fedflat::mix_norm: weight must be one float32 CPU number");
  const int64_t C = g.size(0), P = g.size(1);
  check(m, "mix_norm", "m", C, P);
  const bool avx2 = vectorized(scalar);
  const float w = weight.item<float>();
  at::Tensor norms = at::empty({C, 1}, g.options());
  for (int64_t c = 0; c < C; ++c) {
    norms.data_ptr<float>()[c] = mixed_norm(avx2, g.data_ptr<float>() + c * P, row(m, c), w, P);
  }
  return norms;
}

// C float32 CPU numbers, one a row (a [C] or [C, 1] tensor)
void check_per_row(const at::Tensor& t, const char* name, int64_t C) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.numel() == C && t.is_contiguous(),
              "fedflat::sam_point: ", name, " must be C contiguous float32 CPU numbers");
}

void sam_point(const at::Tensor& u, const at::Tensor& d, double radius, const c10::optional<at::Tensor>& radii,
               const at::Tensor& W, at::Tensor point, bool scalar) {
  TORCH_CHECK(u.dim() == 2 && u.is_contiguous() && W.is_contiguous() && point.is_contiguous() &&
                  u.sizes() == W.sizes() && point.sizes() == W.sizes(),
              "fedflat::sam_point: u, W and point must be contiguous tensors of one [C, P] shape");
  const int64_t C = W.size(0), P = W.size(1);
  check(u, "sam_point", "u", C, P);
  check(W, "sam_point", "W", C, P);
  check(point, "sam_point", "point", C, P);
  check_per_row(d, "d", C);
  if (radii) check_per_row(*radii, "radii", C);
  const bool avx2 = vectorized(scalar);
  for (int64_t c = 0; c < C; ++c) {
    const float r = radii ? radii->const_data_ptr<float>()[c] : static_cast<float>(radius);
    sam_shift(avx2, u.const_data_ptr<float>() + c * P, W.const_data_ptr<float>() + c * P, r,
              d.const_data_ptr<float>()[c], point.data_ptr<float>() + c * P, P);
  }
}

void point_sum(const at::Tensor& W, const at::Tensor& eps, at::Tensor out, bool scalar) {
  TORCH_CHECK(W.is_contiguous() && eps.is_contiguous() && out.is_contiguous() && eps.sizes() == W.sizes() &&
                  out.sizes() == W.sizes(),
              "fedflat::point_sum: W, eps and out must be contiguous tensors of one shape");
  for (const at::Tensor& t : {W, eps, out}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "fedflat::point_sum: float32 CPU tensors");
  }
  const float *w = W.const_data_ptr<float>(), *e = eps.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
#ifdef FEDFLAT_X86
  if (vectorized(scalar)) return sum_avx2(w, e, o, W.numel());
#endif
  sum_scalar(w, e, o, W.numel());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedflat, m) {
  m.def("point_sum(Tensor W, Tensor eps, Tensor(a!) out, bool scalar=False) -> ()", &point_sum);
  m.def("sam_point(Tensor u, Tensor d, float radius, Tensor? radii, Tensor W, Tensor(a!) point, bool scalar=False) "
        "-> ()", &sam_point);
  m.def("mix_norm(Tensor(a!) g, Tensor m, Tensor weight, bool scalar=False) -> Tensor", &mix_norm);
  m.def("guided_point(Tensor w_start, Tensor W, Tensor m, float alpha, float radius, Tensor(a!) point, "
        "bool scalar=False) -> ()", &guided_point);
}

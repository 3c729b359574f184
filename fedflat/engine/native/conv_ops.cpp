// fedflat's native pooling kernels for the hand-derived CNN gradient (fedflat/engine/gradients/convnet.py).
//
// fedflat's CNN applies ReLU and then a 2x2 max pooling of stride 2 to each convolution's output. ATen's max pooling
// of a contiguous (NCHW) float tensor walks every window element by element with 64-bit indices (about 2.6 ms for a
// [10, 64, 28, 28] batch on one core, as long as the convolution before it); these two kernels do the same
// selection in one pass each and fold ReLU and its backward in:
//
//   relu_max_pool2(z) -> (p, code): p[n, c, i, j] = max over the window {(2i, 2j), (2i, 2j+1), (2i+1, 2j),
//     (2i+1, 2j+1)} of relu(z), the first maximum in that order winning, a NaN replacing the maximum (ATen's
//     `(val > maxval) || isnan(val)`); relu(v) as ATen's: +0 for v < 0, v otherwise (-0 and NaN kept).
//     code[n, c, i, j] is the winner's place 0-3, or 4 where p <= 0 (relu's backward passes no gradient there).
//   max_pool2_backward(g, code, H, W) -> dz: zeros except 0 + g[n, c, i, j] at the winner of each window with a code
//     below 4: ATen's max_pool2d_with_indices_backward (a zero-filled input gradient, the output gradient added at
//     the maximum's index) followed by threshold_backward(., relu(z), 0), value for value.
//
// Floor mode: an odd last row or column belongs to no window (its gradient is 0). Compiled with
// -ffp-contract=off; the only arithmetic is the sum 0 + g, which turns a -0 gradient into +0 as ATen's does.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr uint8_t kNoGradient = 4;  // the code of a window whose maximum is <= 0

// Four windows at a time in 16-byte vectors (GCC's and Clang's vector extensions: SSE2 on any x86-64, NEON on ARM).
// Which element wins is data, so nothing branches on it: a mispredicted branch per element is what makes ATen's
// NCHW loop slow (and a scalar version of this one only twice as fast as ATen's).
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef uint8_t v4b __attribute__((vector_size(4)));
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, i, j, k, l) __builtin_shufflevector(a, b, i, j, k, l)
#else
#define SHUFFLE(a, b, i, j, k, l) __builtin_shuffle(a, b, v4i{i, j, k, l})
#endif

inline v4f load4(const float* p) {
  v4f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store4(float* p, v4f v) { std::memcpy(p, &v, sizeof v); }

// ATen's relu: +0 for v < 0, v otherwise (-0 and NaN kept)
inline v4f relu(v4f v) { return (v4f)((v4i)v & ~(v < 0.0f)); }

// ATen's pooling step: v replaces the maximum where it is larger or NaN (the first of equal maxima stays)
inline void take(v4f& best, v4i& at, v4f v, int32_t k) {
  const v4i wins = (v > best) | (v != v);
  best = (v4f)(((v4i)v & wins) | ((v4i)best & ~wins));
  at = (v4i{k, k, k, k} & wins) | (at & ~wins);
}

// Four windows from 8 floats of a top and a bottom row. The first element needs no step: ATen starts from -inf,
// below anything relu gives.
inline void pool4(const float* top, const float* bottom, v4f& best, v4i& at) {
  const v4f t0 = load4(top), t1 = load4(top + 4), b0 = load4(bottom), b1 = load4(bottom + 4);
  best = relu(SHUFFLE(t0, t1, 0, 2, 4, 6));
  at = v4i{0, 0, 0, 0};
  take(best, at, relu(SHUFFLE(t0, t1, 1, 3, 5, 7)), 1);
  take(best, at, relu(SHUFFLE(b0, b1, 0, 2, 4, 6)), 2);
  take(best, at, relu(SHUFFLE(b0, b1, 1, 3, 5, 7)), 3);
  const v4i none = best <= 0.0f;  // (NaN: false, as threshold_backward's r <= 0)
  at = (v4i{kNoGradient, kNoGradient, kNoGradient, kNoGradient} & none) | (at & ~none);
}

// One row of Wo windows (a last partial block through zero-padded copies: no branch on the data there either)
void pool_row(const float* top, const float* bottom, float* out, uint8_t* where, int64_t Wo) {
  v4f best;
  v4i at;
  int64_t j = 0;
  for (; j + 4 <= Wo; j += 4) {
    pool4(top + 2 * j, bottom + 2 * j, best, at);
    store4(out + j, best);
    const v4b code = __builtin_convertvector(at, v4b);
    std::memcpy(where + j, &code, 4);
  }
  if (j < Wo) {
    const int64_t n = Wo - j;
    float t[8] = {}, b[8] = {}, o[4];
    for (int64_t k = 0; k < 2 * n; ++k) t[k] = top[2 * j + k], b[k] = bottom[2 * j + k];
    pool4(t, b, best, at);
    store4(o, best);
    const v4b code = __builtin_convertvector(at, v4b);
    for (int64_t k = 0; k < n; ++k) out[j + k] = o[k], where[j + k] = code[k];
  }
}

// 0 + g at each window's winner, zeros elsewhere (0 + g: a -0 gradient becomes +0, as ATen's zero-filled sum)
inline void unpool4(const float* g, const uint8_t* where, float* top, float* bottom) {
  const v4f v = load4(g) + 0.0f;
  v4b code;
  std::memcpy(&code, where, 4);
  const v4i at = __builtin_convertvector(code, v4i);
  const v4f e0 = (v4f)((v4i)v & (at == 0)), o0 = (v4f)((v4i)v & (at == 1));
  const v4f e1 = (v4f)((v4i)v & (at == 2)), o1 = (v4f)((v4i)v & (at == 3));
  store4(top, SHUFFLE(e0, o0, 0, 4, 1, 5));
  store4(top + 4, SHUFFLE(e0, o0, 2, 6, 3, 7));
  store4(bottom, SHUFFLE(e1, o1, 0, 4, 1, 5));
  store4(bottom + 4, SHUFFLE(e1, o1, 2, 6, 3, 7));
}

void unpool_row(const float* g, const uint8_t* where, float* top, float* bottom, int64_t Wo) {
  int64_t j = 0;
  for (; j + 4 <= Wo; j += 4) unpool4(g + j, where + j, top + 2 * j, bottom + 2 * j);
  for (; j < Wo; ++j) {
    const uint8_t at = where[j];
    const float v = at == kNoGradient ? 0.0f : 0.0f + g[j];
    top[2 * j] = at == 0 ? v : 0.0f;
    top[2 * j + 1] = at == 1 ? v : 0.0f;
    bottom[2 * j] = at == 2 ? v : 0.0f;
    bottom[2 * j + 1] = at == 3 ? v : 0.0f;
  }
}

void check_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous(),
              "fedflat::", name, ": a contiguous float32 [N, C, H, W] CPU tensor expected");
}

std::tuple<at::Tensor, at::Tensor> relu_max_pool2(const at::Tensor& z) {
  check_input(z, "relu_max_pool2");
  const int64_t H = z.size(2), W = z.size(3), Ho = H / 2, Wo = W / 2;
  at::Tensor p = at::empty({z.size(0), z.size(1), Ho, Wo}, z.options());
  at::Tensor code = at::empty({z.size(0), z.size(1), Ho, Wo}, z.options().dtype(at::kByte));
  const float* in = z.const_data_ptr<float>();
  float* out = p.mutable_data_ptr<float>();
  uint8_t* where = code.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, z.size(0) * z.size(1) * Ho, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {  // (row = plane * Ho + i)
      const float* top = in + (row / Ho) * H * W + 2 * (row % Ho) * W;
      pool_row(top, top + W, out + row * Wo, where + row * Wo, Wo);
    }
  });
  return {p, code};
}

at::Tensor max_pool2_backward(const at::Tensor& g, const at::Tensor& code, int64_t H, int64_t W) {
  check_input(g, "max_pool2_backward");
  const int64_t Ho = H / 2, Wo = W / 2;
  TORCH_CHECK(g.size(2) == Ho && g.size(3) == Wo && code.sizes() == g.sizes() && code.scalar_type() == at::kByte &&
                  code.is_contiguous(),
              "fedflat::max_pool2_backward: g and code of [N, C, H/2, W/2] expected");
  at::Tensor dz = (H % 2 || W % 2) ? at::zeros({g.size(0), g.size(1), H, W}, g.options())
                                   : at::empty({g.size(0), g.size(1), H, W}, g.options());
  const float* grad = g.const_data_ptr<float>();
  const uint8_t* where = code.const_data_ptr<uint8_t>();
  float* out = dz.mutable_data_ptr<float>();
  at::parallel_for(0, g.size(0) * g.size(1) * Ho, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* top = out + (row / Ho) * H * W + 2 * (row % Ho) * W;
      unpool_row(grad + row * Wo, where + row * Wo, top, top + W, Wo);
    }
  });
  return dz;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedflat, m) {
  m.def("relu_max_pool2(Tensor z) -> (Tensor, Tensor)", &relu_max_pool2);
  m.def("max_pool2_backward(Tensor g, Tensor code, int H, int W) -> Tensor", &max_pool2_backward);
}

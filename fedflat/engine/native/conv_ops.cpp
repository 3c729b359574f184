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
// Floor mode: an odd last row or column belongs to no window (its gradient is 0). float32 or bfloat16 (precision:
// bf16, whose layers autocast runs in bfloat16: the same selection on the exactly widened values, a NaN stored as
// c10's 0x7FC0 as ATen's bfloat16 kernels store it). Compiled with -ffp-contract=off; the only arithmetic is the sum
// 0 + g, which turns a -0 gradient into +0 as ATen's does.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#if defined(__SSE2__)
#include <emmintrin.h>  // (x86-64's baseline: the narrowing packs, which generic vectors lower element by element)
#endif

namespace {

constexpr uint8_t kNoGradient = 4;  // the code of a window whose maximum is <= 0

// Four windows at a time in 16-byte vectors (GCC's and Clang's vector extensions: SSE2 on any x86-64, NEON on ARM).
// Which element wins is data, so nothing branches on it: a mispredicted branch per element is what makes ATen's
// NCHW loop slow (and a scalar version of this one only twice as fast as ATen's).
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef uint8_t v4b __attribute__((vector_size(4)));
typedef uint16_t v8h __attribute__((vector_size(16)));
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, v4i{__VA_ARGS__})
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, v8h{__VA_ARGS__})
#endif

inline v4f load4(const float* p) {
  v4f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store4(float* p, v4f v) { std::memcpy(p, &v, sizeof v); }

// bfloat16, as its bits: widened exactly (the 16 bits on top of a float's: zeros interleaved below them), narrowed
// exactly where the float holds a bfloat16 value (its top 16 bits), as c10::BFloat16 does; a NaN becomes c10's 0x7FC0
inline v4f widen(v8h h, bool high) {
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  return (v4f)(high ? _mm_unpackhi_epi16(zero, (__m128i)h) : _mm_unpacklo_epi16(zero, (__m128i)h));
#else
  const v8h zero = {0, 0, 0, 0, 0, 0, 0, 0};
  return (v4f)(high ? SHUFFLE8(zero, h, 0, 12, 0, 13, 0, 14, 0, 15) : SHUFFLE8(zero, h, 0, 8, 0, 9, 0, 10, 0, 11));
#endif
}

inline v4f load4(const uint16_t* p) {
  v8h h = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(&h, p, 4 * sizeof(uint16_t));
  return widen(h, false);
}

inline void store4(uint16_t* p, v4f v) {
  const v4i nan = v != v;
  const v4i top = (((v4i)v & ~nan) | (0x7FC00000 & nan)) >> 16;  // (arithmetic: each an int16 of the same bits)
#if defined(__SSE2__)
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi32((__m128i)top, (__m128i)top));
#else
  const v8h halves = SHUFFLE8((v8h)top, (v8h)top, 0, 2, 4, 6, 0, 2, 4, 6);  // (little-endian: each low half)
  std::memcpy(p, &halves, 4 * sizeof(uint16_t));
#endif
}

// The four windows' codes (0-4) as bytes, and back
inline void store_codes(uint8_t* where, v4i at) {
#if defined(__SSE2__)
  const __m128i words = _mm_packs_epi32((__m128i)at, (__m128i)at);
  const int32_t bytes = _mm_cvtsi128_si32(_mm_packus_epi16(words, words));
  std::memcpy(where, &bytes, sizeof bytes);
#else
  const v4b code = __builtin_convertvector(at, v4b);
  std::memcpy(where, &code, sizeof code);
#endif
}

inline v4i load_codes(const uint8_t* where) {
#if defined(__SSE2__)
  int32_t bytes;
  std::memcpy(&bytes, where, sizeof bytes);
  const __m128i zero = _mm_setzero_si128();
  return (v4i)_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(bytes), zero), zero);
#else
  v4b code;
  std::memcpy(&code, where, sizeof code);
  return __builtin_convertvector(code, v4i);
#endif
}

// 8 elements as two vectors of 4: one 16-byte load of bfloat16, two of float32
inline void load8(const float* p, v4f& low, v4f& high) {
  low = load4(p);
  high = load4(p + 4);
}

inline void load8(const uint16_t* p, v4f& low, v4f& high) {
  v8h h;
  std::memcpy(&h, p, sizeof h);
  low = widen(h, false);
  high = widen(h, true);
}

// ATen's relu: +0 for v < 0, v otherwise (-0 and NaN kept)
inline v4f relu(v4f v) { return (v4f)((v4i)v & ~(v < 0.0f)); }

// ATen's pooling step: v replaces the maximum where it is larger or NaN (the first of equal maxima stays)
inline void take(v4f& best, v4i& at, v4f v, int32_t k) {
  const v4i wins = (v > best) | (v != v);
  best = (v4f)(((v4i)v & wins) | ((v4i)best & ~wins));
  at = (v4i{k, k, k, k} & wins) | (at & ~wins);
}

// Four windows from 8 elements of a top and a bottom row. The first element needs no step: ATen starts from -inf,
// below anything relu gives.
template <typename T>
void pool4(const T* top, const T* bottom, T* out, uint8_t* where) {
  v4f t0, t1, b0, b1;
  load8(top, t0, t1);
  load8(bottom, b0, b1);
  v4f best = relu(SHUFFLE(t0, t1, 0, 2, 4, 6));
  v4i at = {0, 0, 0, 0};
  take(best, at, relu(SHUFFLE(t0, t1, 1, 3, 5, 7)), 1);
  take(best, at, relu(SHUFFLE(b0, b1, 0, 2, 4, 6)), 2);
  take(best, at, relu(SHUFFLE(b0, b1, 1, 3, 5, 7)), 3);
  const v4i none = best <= 0.0f;  // (NaN: false, as threshold_backward's r <= 0)
  at = (v4i{kNoGradient, kNoGradient, kNoGradient, kNoGradient} & none) | (at & ~none);
  store4(out, best);
  store_codes(where, at);
}

// One row of Wo windows (a last partial block through zero-padded copies: no branch on the data there either)
template <typename T>
void pool_row(const T* top, const T* bottom, T* out, uint8_t* where, int64_t Wo) {
  int64_t j = 0;
  for (; j + 4 <= Wo; j += 4) pool4(top + 2 * j, bottom + 2 * j, out + j, where + j);
  if (j < Wo) {
    const int64_t n = Wo - j;
    T t[8] = {}, b[8] = {}, o[4];
    uint8_t w[4];
    for (int64_t k = 0; k < 2 * n; ++k) t[k] = top[2 * j + k], b[k] = bottom[2 * j + k];
    pool4(t, b, o, w);
    for (int64_t k = 0; k < n; ++k) out[j + k] = o[k], where[j + k] = w[k];
  }
}

// 0 + g at each window's winner, zeros elsewhere (0 + g: a -0 gradient becomes +0, as ATen's zero-filled sum)
template <typename T>
void unpool4(const T* g, const uint8_t* where, T* top, T* bottom) {
  const v4f v = load4(g) + 0.0f;
  const v4i at = load_codes(where);
  const v4f e0 = (v4f)((v4i)v & (at == 0)), o0 = (v4f)((v4i)v & (at == 1));
  const v4f e1 = (v4f)((v4i)v & (at == 2)), o1 = (v4f)((v4i)v & (at == 3));
  store4(top, SHUFFLE(e0, o0, 0, 4, 1, 5));
  store4(top + 4, SHUFFLE(e0, o0, 2, 6, 3, 7));
  store4(bottom, SHUFFLE(e1, o1, 0, 4, 1, 5));
  store4(bottom + 4, SHUFFLE(e1, o1, 2, 6, 3, 7));
}

template <typename T>
void unpool_row(const T* g, const uint8_t* where, T* top, T* bottom, int64_t Wo) {
  int64_t j = 0;
  for (; j + 4 <= Wo; j += 4) unpool4(g + j, where + j, top + 2 * j, bottom + 2 * j);
  if (j < Wo) {
    const int64_t n = Wo - j;
    T gg[4] = {}, t[8], b[8];
    uint8_t w[4] = {kNoGradient, kNoGradient, kNoGradient, kNoGradient};
    for (int64_t k = 0; k < n; ++k) gg[k] = g[j + k], w[k] = where[j + k];
    unpool4(gg, w, t, b);
    for (int64_t k = 0; k < 2 * n; ++k) top[2 * j + k] = t[k], bottom[2 * j + k] = b[k];
  }
}

void check_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4 && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.device().is_cpu() && t.is_contiguous(),
              "fedflat::", name, ": a contiguous float32 or bfloat16 [N, C, H, W] CPU tensor expected");
}

template <typename T>
const T* data(const at::Tensor& t) {
  return static_cast<const T*>(t.const_data_ptr());
}

template <typename T>
T* data(at::Tensor& t) {
  return static_cast<T*>(t.mutable_data_ptr());
}

template <typename T>
void pool_rows(const at::Tensor& z, at::Tensor& p, at::Tensor& code) {
  const int64_t H = z.size(2), W = z.size(3), Ho = H / 2, Wo = W / 2;
  const T* in = data<T>(z);
  T* out = data<T>(p);
  uint8_t* where = data<uint8_t>(code);
  at::parallel_for(0, z.size(0) * z.size(1) * Ho, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {  // (row = plane * Ho + i)
      const T* top = in + (row / Ho) * H * W + 2 * (row % Ho) * W;
      pool_row(top, top + W, out + row * Wo, where + row * Wo, Wo);
    }
  });
}

template <typename T>
void unpool_rows(const at::Tensor& g, const at::Tensor& code, at::Tensor& dz) {
  const int64_t H = dz.size(2), W = dz.size(3), Ho = H / 2, Wo = W / 2;
  const T* grad = data<T>(g);
  const uint8_t* where = data<uint8_t>(code);
  T* out = data<T>(dz);
  at::parallel_for(0, g.size(0) * g.size(1) * Ho, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* top = out + (row / Ho) * H * W + 2 * (row % Ho) * W;
      unpool_row(grad + row * Wo, where + row * Wo, top, top + W, Wo);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> relu_max_pool2(const at::Tensor& z) {
  check_input(z, "relu_max_pool2");
  at::Tensor p = at::empty({z.size(0), z.size(1), z.size(2) / 2, z.size(3) / 2}, z.options());
  at::Tensor code = at::empty(p.sizes(), z.options().dtype(at::kByte));
  if (z.scalar_type() == at::kFloat) {
    pool_rows<float>(z, p, code);
  } else {
    pool_rows<uint16_t>(z, p, code);
  }
  return {p, code};
}

at::Tensor max_pool2_backward(const at::Tensor& g, const at::Tensor& code, int64_t H, int64_t W) {
  check_input(g, "max_pool2_backward");
  TORCH_CHECK(g.size(2) == H / 2 && g.size(3) == W / 2 && code.sizes() == g.sizes() &&
                  code.scalar_type() == at::kByte && code.is_contiguous(),
              "fedflat::max_pool2_backward: g and code of [N, C, H/2, W/2] expected");
  at::Tensor dz = (H % 2 || W % 2) ? at::zeros({g.size(0), g.size(1), H, W}, g.options())
                                   : at::empty({g.size(0), g.size(1), H, W}, g.options());
  if (g.scalar_type() == at::kFloat) {
    unpool_rows<float>(g, code, dz);
  } else {
    unpool_rows<uint16_t>(g, code, dz);
  }
  return dz;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedflat, m) {
  m.def("relu_max_pool2(Tensor z) -> (Tensor, Tensor)", &relu_max_pool2);
  m.def("max_pool2_backward(Tensor g, Tensor code, int H, int W) -> Tensor", &max_pool2_backward);
}

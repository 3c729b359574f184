// FedFFT's band removal (fedflat/algorithms/fedfft.py, remove_low_band) for one long tensor, as one native call.
//
// y = x - iRFFT(V[:K], n) for x of n = n2 n1 entries, V = rFFT(x), by the pruned four-step transform: with
// X[a, b] = x[a n1 + b] (n2 rows of n1 columns),
//     R[k, b] = rFFT_a(X[:, b])[k]                  the n1 column transforms of length n2, k < K
//     V_k = sum_b T[k, b] R[k, b]                    T[k, b] = exp(-2 pi i k b / n)
//     L[a, b] = iRFFT_a(V_k S[k, b])[a]              S = conj(T) / n1, zero for k >= K; iRFFT divides by n2
//     y = X - L.
// Each real transform of length n2 = 2 M is a complex one of length M (z[m] = x[2m] + i x[2m + 1], then the split
// into even and odd halves), computed by a Stockham FFT with radices 4, 2, 3 and 5 on 8 columns at once: every
// butterfly works on 8-float vectors, one column a lane, so the same operations run in AVX registers (the avx2 clone,
// where the CPU has AVX2) or in two SSE halves (the default clone): the same bits on every x86 CPU, products and sums
// rounded separately (no fma). The twiddles are computed in double and rounded to float once; T[k, b] is the product
// of two of them (exp(-2 pi i k l / n) exp(-2 pi i k 8 q / n) for b = 8 q + l), so the call reads 2 K (8 + n1 / 8)
// numbers rather than T's and S's 2 K n1 (1.2 MB for W1's 784 x 200 weight, which in the local loop cost more than
// the transforms). V_k's terms are added column by column in order. Within the FFT error bound O(u log n) ||x|| of
// the exact band, like scipy's pocketfft (tests/test_fft.py); in W1's local loop about half its time
// (docs/benchmarks.md). The scalar loops are as slow as one column at a time is: they serve a CPU without AVX2.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <torch/library.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <algorithm>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

// (8-float vectors pass between the inlined helpers only; the default clone keeps them in SSE halves)
#pragma GCC diagnostic ignored "-Wpsabi"

namespace {

typedef float v8 __attribute__((vector_size(32)));  // one float of 8 columns
constexpr int64_t kWidth = 8;

struct Cv {  // a complex number of 8 columns
  v8 re, im;
};

struct Cf {
  float re, im;
};

#define FEDFLAT_INLINE inline __attribute__((always_inline))

FEDFLAT_INLINE Cv operator+(Cv a, Cv b) { return {a.re + b.re, a.im + b.im}; }
FEDFLAT_INLINE Cv operator-(Cv a, Cv b) { return {a.re - b.re, a.im - b.im}; }
FEDFLAT_INLINE Cv times(Cv a, Cf w) { return {a.re * w.re - a.im * w.im, a.re * w.im + a.im * w.re}; }
FEDFLAT_INLINE Cv times(Cv a, Cv w) { return {a.re * w.re - a.im * w.im, a.re * w.im + a.im * w.re}; }
FEDFLAT_INLINE Cv times_i(Cv a, float sign) {  // a * (sign i)
  return {-sign * a.im, sign * a.re};
}
FEDFLAT_INLINE Cv conj(Cv a) { return {a.re, -a.im}; }

Cf unit(double turns) {  // exp(2 pi i turns), rounded to float once
  const double angle = 2.0 * M_PI * turns;
  return {static_cast<float>(std::cos(angle)), static_cast<float>(std::sin(angle))};
}

// A complex transform of length M by radices: per pass its radix p, span Ns (the product of the earlier radices) and
// twiddles exp(-+2 pi i r k / (Ns p)), k < Ns, r < p, for the forward and the inverse transform.
struct Plan {
  int64_t M = 0;
  std::vector<int64_t> radix, span;
  std::vector<std::vector<Cf>> forward, inverse;
  std::vector<Cf> split;  // exp(-2 pi i k / (2 M)), k <= M: the real transform's split into even and odd halves
};

std::shared_ptr<const Plan> plan_of(int64_t M) {
  static std::mutex lock;
  static std::map<int64_t, std::shared_ptr<const Plan>> plans;
  std::lock_guard<std::mutex> guard(lock);
  auto found = plans.find(M);
  if (found != plans.end()) return found->second;
  auto plan = std::make_shared<Plan>();
  plan->M = M;
  int64_t rest = M, Ns = 1;
  for (const int64_t p : {4, 2, 3, 5}) {
    while (rest % p == 0) {
      plan->radix.push_back(p);
      plan->span.push_back(Ns);
      std::vector<Cf> forward(Ns * p), inverse(Ns * p);
      for (int64_t k = 0; k < Ns; ++k) {
        for (int64_t r = 0; r < p; ++r) {
          forward[k * p + r] = unit(-static_cast<double>(r * k) / static_cast<double>(Ns * p));
          inverse[k * p + r] = {forward[k * p + r].re, -forward[k * p + r].im};
        }
      }
      plan->forward.push_back(std::move(forward));
      plan->inverse.push_back(std::move(inverse));
      Ns *= p;
      rest /= p;
    }
  }
  TORCH_CHECK(rest == 1, "fedflat::remove_low_band: n2 / 2 must have no prime factor above 5");
  for (int64_t k = 0; k <= M; ++k) plan->split.push_back(unit(-static_cast<double>(k) / static_cast<double>(2 * M)));
  plans.emplace(M, plan);
  return plan;
}

// The DFT of p = 2, 3, 4 or 5 points, exp(sign 2 pi i q r / p) (sign -1 forward, +1 inverse).
template <int p>
FEDFLAT_INLINE void butterfly(const Cv* a, Cv* b, float sign) {
  if constexpr (p == 2) {
    b[0] = a[0] + a[1];
    b[1] = a[0] - a[1];
  } else if constexpr (p == 3) {
    const float c = -0.5f, s = static_cast<float>(0.86602540378443864676);  // cos, sin(2 pi / 3)
    const Cv t1 = a[1] + a[2], t2 = a[1] - a[2];
    const Cv m = a[0] + Cv{t1.re * c, t1.im * c}, n = times_i(Cv{t2.re * s, t2.im * s}, sign);
    b[0] = a[0] + t1;
    b[1] = m + n;
    b[2] = m - n;
  } else if constexpr (p == 4) {
    const Cv t0 = a[0] + a[2], t1 = a[0] - a[2], t2 = a[1] + a[3], t3 = times_i(a[1] - a[3], sign);
    b[0] = t0 + t2;
    b[2] = t0 - t2;
    b[1] = t1 + t3;
    b[3] = t1 - t3;
  } else {
    const float c1 = static_cast<float>(0.30901699437494742410), c2 = static_cast<float>(-0.80901699437494742410);
    const float s1 = static_cast<float>(0.95105651629515357212), s2 = static_cast<float>(0.58778525229247312917);
    const Cv t1 = a[1] + a[4], t2 = a[2] + a[3], t3 = a[1] - a[4], t4 = a[2] - a[3];
    const Cv m1 = a[0] + Cv{t1.re * c1, t1.im * c1} + Cv{t2.re * c2, t2.im * c2};
    const Cv m2 = a[0] + Cv{t1.re * c2, t1.im * c2} + Cv{t2.re * c1, t2.im * c1};
    const Cv n1 = times_i(Cv{t3.re * s1 + t4.re * s2, t3.im * s1 + t4.im * s2}, sign);
    const Cv n2 = times_i(Cv{t3.re * s2 - t4.re * s1, t3.im * s2 - t4.im * s1}, sign);
    b[0] = a[0] + t1 + t2;
    b[1] = m1 + n1;
    b[4] = m1 - n1;
    b[2] = m2 + n2;
    b[3] = m2 - n2;
  }
}

// One Stockham pass of radix p: out[g Ns p + k + q Ns] = DFT_p(tw_r in[g Ns + k + r M / p])_q.
template <int p>
FEDFLAT_INLINE void pass(int64_t M, int64_t Ns, const Cf* tw, const Cv* in, Cv* out, float sign) {
  const int64_t m = M / p;
  for (int64_t g = 0; g < m / Ns; ++g) {
    for (int64_t k = 0; k < Ns; ++k) {
      const int64_t j = g * Ns + k;
      Cv a[p], b[p];
      a[0] = in[j];
#pragma GCC unroll 4
      for (int r = 1; r < p; ++r) a[r] = times(in[j + r * m], tw[k * p + r]);
      butterfly<p>(a, b, sign);
      const int64_t base = g * Ns * p + k;
#pragma GCC unroll 5
      for (int q = 0; q < p; ++q) out[base + q * Ns] = b[q];
    }
  }
}

// The complex transform of `a` (sign -1 forward, +1 inverse, unnormalized), using `b` as scratch; returns where the
// result is.
FEDFLAT_INLINE Cv* transform(const Plan& plan, Cv* a, Cv* b, float sign) {
  for (size_t s = 0; s < plan.radix.size(); ++s) {
    const Cf* tw = (sign < 0 ? plan.forward[s] : plan.inverse[s]).data();
    const int64_t M = plan.M, Ns = plan.span[s];
    switch (plan.radix[s]) {
      case 2: pass<2>(M, Ns, tw, a, b, sign); break;
      case 3: pass<3>(M, Ns, tw, a, b, sign); break;
      case 4: pass<4>(M, Ns, tw, a, b, sign); break;
      default: pass<5>(M, Ns, tw, a, b, sign); break;
    }
    std::swap(a, b);
  }
  return a;
}

FEDFLAT_INLINE v8 load(const float* p, int64_t width) {  // width floats from p, zeros after
  v8 v = {};
  if (width == kWidth) {
    std::memcpy(&v, p, sizeof(v8));
  } else {
    std::memcpy(&v, p, sizeof(float) * width);
  }
  return v;
}

FEDFLAT_INLINE void store(float* p, v8 v, int64_t width) {
  if (width == kWidth) {
    std::memcpy(p, &v, sizeof(v8));
  } else {
    std::memcpy(p, &v, sizeof(float) * width);
  }
}

// T[k, b] = exp(-2 pi i k b / n) of the block b0 = 8 q, lane l as within[k] (exp(-2 pi i k l / n), one lane each)
// times across[k * blocks + q] (exp(-2 pi i k 8 q / n)): 2 K (8 + blocks) numbers instead of the K n1 of T and S.
struct Band {
  std::vector<Cf> within, across;
  int64_t blocks = 0;
};

std::shared_ptr<const Band> band_of(int64_t n, int64_t n1, int64_t K) {
  static std::mutex lock;
  static std::map<std::tuple<int64_t, int64_t, int64_t>, std::shared_ptr<const Band>> bands;
  std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_tuple(n, n1, K);
  auto found = bands.find(key);
  if (found != bands.end()) return found->second;
  auto band = std::make_shared<Band>();
  band->blocks = (n1 + kWidth - 1) / kWidth;
  band->within.resize(K * kWidth);
  band->across.resize(K * band->blocks);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t l = 0; l < kWidth; ++l)
      band->within[k * kWidth + l] = unit(-static_cast<double>((k * l) % n) / static_cast<double>(n));
    for (int64_t q = 0; q < band->blocks; ++q)
      band->across[k * band->blocks + q] = unit(-static_cast<double>((k * kWidth * q) % n) / static_cast<double>(n));
  }
  bands.emplace(key, band);
  return band;
}

// Cv's in 64-byte aligned memory (the AVX clone moves them with aligned loads and stores).
struct Scratch {
  explicit Scratch(int64_t count) : raw(static_cast<size_t>(count) * sizeof(Cv) + 64) {
    void* p = raw.data();
    size_t space = raw.size();
    data = static_cast<Cv*>(std::align(64, raw.size() - 64, p, space));
  }
  std::vector<unsigned char> raw;
  Cv* data;
};

FEDFLAT_INLINE Cv lanes_of(const Cf* w) {  // 8 complex numbers, one a lane
  Cv c = {{}, {}};
  for (int64_t l = 0; l < kWidth; ++l) {
    c.re[l] = w[l].re;
    c.im[l] = w[l].im;
  }
  return c;
}

FEDFLAT_INLINE Cf times(Cf a, Cf b) { return {a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re}; }

// Y[k, b] = V_k S[k, b] = conj(within[k]) (conj(across[k, q]) V_k / n1) of block q's columns (zero for k >= K).
FEDFLAT_INLINE Cv spectrum_at(int64_t k, int64_t K, int64_t q, const Band& band, const std::vector<Cf>& V,
                              const Cv* within, float per_column) {
  if (k >= K) return Cv{{}, {}};
  const Cf across = band.across[k * band.blocks + q];
  return times(conj(within[k]), times(Cf{across.re, -across.im}, Cf{V[k].re * per_column, V[k].im * per_column}));
}

// The whole removal (the file's head), 8 columns at a time; T[k, b] from the band's tables, S = conj(T) / n1.
FEDFLAT_INLINE void remove_band(const float* x, int64_t n2, int64_t n1, int64_t K, float* y) {
  const int64_t M = n2 / 2;
  const auto plan_ptr = plan_of(M);
  const auto band_ptr = band_of(n2 * n1, n1, K);
  const Plan& plan = *plan_ptr;
  const Band& band = *band_ptr;
  Scratch scratch(2 * M + K);  // the transform's two buffers, and the lanes' twiddles exp(-2 pi i k l / n)
  Cv *one = scratch.data, *two = one + M, *within = two + M;
  for (int64_t k = 0; k < K; ++k) within[k] = lanes_of(&band.within[k * kWidth]);
  std::vector<Cf> V(K, Cf{0.0f, 0.0f});
  // forward: each block's column transforms, then its terms of V_k = sum_b T[k, b] R[k, b], column by column
  for (int64_t b0 = 0, q = 0; b0 < n1; b0 += kWidth, ++q) {
    const int64_t width = std::min(kWidth, n1 - b0);
    for (int64_t m = 0; m < M; ++m) {
      one[m].re = load(x + (2 * m) * n1 + b0, width);
      one[m].im = load(x + (2 * m + 1) * n1 + b0, width);
    }
    const Cv* Z = transform(plan, one, two, -1.0f);
    for (int64_t k = 0; k < K; ++k) {
      const Cv zk = Z[k], zc = conj(Z[k == 0 ? 0 : M - k]);
      const Cv even = zk + zc, odd = times_i(zk - zc, -1.0f);  // 2 X_e[k], 2 X_o[k]
      const Cv twice = even + times(odd, plan.split[k]);   // 2 R[k]
      const Cv R = {twice.re * 0.5f, twice.im * 0.5f};
      const Cv terms = times(times(R, within[k]), band.across[k * band.blocks + q]);
      float re = V[k].re, im = V[k].im;
      for (int64_t l = 0; l < width; ++l) {
        re = re + terms.re[l];
        im = im + terms.im[l];
      }
      V[k] = {re, im};
    }
  }
  // inverse: each block's half-spectrum Y[k, b] = V_k S[k, b], its real inverse of length n2, and y = x - L
  const float scale = 1.0f / static_cast<float>(n2), per_column = 1.0f / static_cast<float>(n1);
  for (int64_t b0 = 0, q = 0; b0 < n1; b0 += kWidth, ++q) {
    const int64_t width = std::min(kWidth, n1 - b0);
    for (int64_t k = 0; k < M; ++k) {
      const Cv yk = spectrum_at(k, K, q, band, V, within, per_column);
      const Cv yc = conj(spectrum_at(M - k, K, q, band, V, within, per_column));
      const Cv even = yk + yc, odd = times(yk - yc, Cf{plan.split[k].re, -plan.split[k].im});
      one[k] = even + times_i(odd, 1.0f);
    }
    const Cv* z = transform(plan, one, two, 1.0f);
    for (int64_t m = 0; m < M; ++m) {
      const float* xe = x + (2 * m) * n1 + b0;
      const float* xo = x + (2 * m + 1) * n1 + b0;
      store(y + (2 * m) * n1 + b0, load(xe, width) - z[m].re * scale, width);
      store(y + (2 * m + 1) * n1 + b0, load(xo, width) - z[m].im * scale, width);
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)
#define FEDFLAT_AVX2_CLONE __attribute__((target("avx2")))
#define FEDFLAT_HAS_AVX2() __builtin_cpu_supports("avx2")
#else
#define FEDFLAT_AVX2_CLONE
#define FEDFLAT_HAS_AVX2() false
#endif

FEDFLAT_AVX2_CLONE void remove_band_avx2(const float* x, int64_t n2, int64_t n1, int64_t K, float* y) {
  remove_band(x, n2, n1, K, y);
}

void remove_band_base(const float* x, int64_t n2, int64_t n1, int64_t K, float* y) { remove_band(x, n2, n1, K, y); }

void remove_low_band(const at::Tensor& x, int64_t n2, int64_t removed, at::Tensor out, bool scalar) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 1 && x.is_contiguous() &&
                  out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.numel() == x.numel(),
              "fedflat::remove_low_band: x and out must be contiguous float32 CPU vectors of one length");
  TORCH_CHECK(n2 >= 2 && n2 % 2 == 0 && x.numel() % n2 == 0 && removed >= 0 && removed <= n2 / 2,
              "fedflat::remove_low_band: n2 must be even and divide the length, and removed at most n2 / 2");
  plan_of(n2 / 2);  // (its check, before anything is written)
  const bool avx2 = !scalar && FEDFLAT_HAS_AVX2();
  (avx2 ? remove_band_avx2 : remove_band_base)(x.const_data_ptr<float>(), n2, x.numel() / n2, removed,
                                               out.data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedflat, m) {
  m.def("remove_low_band(Tensor x, int n2, int removed, Tensor(a!) out, bool scalar=False) -> ()",
        &remove_low_band);
}

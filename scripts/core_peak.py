"""One CPU core's peak arithmetic rate, measured: float32 fused multiply-adds (and bfloat16 dot products where the CPU
has AVX512_BF16) from registers, no memory, on one thread, timed by the thread's own CPU clock (so another job on
the machine slows the count of seconds, not the rate).

    python scripts/core_peak.py

The peak is what a core's vector units can retire: for AVX-512 FMA, 16 float32 lanes x 2 FLOP per instruction x the
FMA instructions a cycle (2 on AMD Zen 4 as 256-bit halves, 2 on Intel server cores with two 512-bit units, 1 on
others) x the clock the core runs at, which under turbo is not the nominal one: the loop measures the product of the
last two. It keeps 12 independent accumulators in flight (more than the FMA latency times the units), so it is bound
by throughput. docs/benchmarks.md divides a workload's achieved FLOP/s (``fedflat bench``'s FlopCounterMode count)
by this rate to give the fraction of the core's peak.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <cstdio>
#include <cstring>
#include <ctime>
static double cpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
  const long n = 20000000;
  __m512 a[12];
  const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
  for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
  double best = 0;
  for (int rep = 0; rep < 3; rep++) {
    double t = cpu();
    for (long k = 0; k < n; k++) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], x, y);  // (unrolled: the 12 stay in registers)
    }
    double rate = n * 12.0 * 16 * 2 / (cpu() - t);
    best = rate > best ? rate : best;
  }
  float sink = 0;
  for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_ps(a[i]);
  std::printf("float32 %.1f GFLOP/s (%g)\n", best / 1e9, sink);
#ifdef __AVX512BF16__
  __m512 b[12];
  for (int i = 0; i < 12; i++) b[i] = _mm512_set1_ps((float)i);
  const __m512bh u = (__m512bh)_mm512_set1_epi16(0x3f80);
  best = 0;
  for (int rep = 0; rep < 3; rep++) {
    double t = cpu();
    for (long k = 0; k < n; k++) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; i++) b[i] = _mm512_dpbf16_ps(b[i], u, u);
    }
    double rate = n * 12.0 * 32 * 2 / (cpu() - t);
    best = rate > best ? rate : best;
  }
  sink = 0;
  for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_ps(b[i]);
  std::printf("bfloat16 %.1f GFLOP/s (%g)\n", best / 1e9, sink);
#endif
}
"""


def main() -> int:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        print("no C++ compiler found", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "peak.cpp", Path(folder) / "peak"
        source.write_text(SOURCE)
        built = subprocess.run([cxx, "-O2", "-march=native", str(source), "-o", str(binary)], capture_output=True,
                               text=True)
        if built.returncode:
            print(f"this CPU or compiler has no AVX-512 (the loop measures AVX-512 FMAs): {built.stderr.strip()[:300]}",
                  file=sys.stderr)
            return 1
        print(subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GGUF kernels of two versions of ``gguf_linear.cpp``, interleaved in one process (A/B).

This project's 2-core VMs drift by up to 2x within minutes (benches/RESULTS.md), so two builds timed
in turn, or two runs of one benchmark, cannot resolve a kernel change of 10-20%. This harness compiles
the kernels of a git revision (A, ``--base``, default ``HEAD``) and of the working tree (B) into one
binary (each in its own namespace), and times them in alternating pairs on the same data, one thread:
each pair sees the same machine, and the median of the pairs' ratios B/A resolves ~3-5% here (an A/A
run: medians 0.97-1.04 with 31 pairs). It also says whether the two outputs are bitwise equal.

- ``q8``: ``rows_q8`` (``treeserve::gguf_linear_q8``'s tiles: int8 activations in lanes), Q4_0 / Q4_1 /
  Q8_0 at 8 / 16 / 64 rows on Llama-3-8B's widths, cycles per 32-block and 8 rows of x;
- ``int16``: ``rows_int`` (``treeserve::gguf_linear``'s tiles), 1 and 4 rows on SmolLM2's and 8B's
  widths, cycles per 32-block and row.

Cycles assume 2.75 GHz (this VM's clock measured quiet); only the ratios are figures.

    python benches/bench_kernel_ab.py [--base REV] [--kernels q8,int16] [--pairs 31]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "treeserve/models/csrc/gguf_linear.cpp"
# The kernels: from the anonymous namespace's start to the operators that wrap them.
START, END = "namespace {\n", "// int8 activations: large batches of models whose codes serve every batch"

HARNESS = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include "treeserve_head.h"
#include "treeserve_lanes.h"
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif
namespace vA {
#include "a.inc"
}
namespace vB {
#include "b.inc"
}
using Clock = std::chrono::steady_clock;
constexpr int PAIRS = PAIRS_N;

std::vector<uint8_t> blocks(int64_t n, int64_t nb, int bb, bool q41) {  // random codes, scales 2^-7
  std::mt19937 rng(1);
  std::vector<uint8_t> w(n * nb * bb);
  for (auto& b : w) b = rng() & 255;
  const uint16_t h = 0x2000;
  for (int64_t i = 0; i < n * nb; ++i) {
    std::memcpy(&w[i * bb], &h, 2);
    if (q41) std::memcpy(&w[i * bb + 2], &h, 2);
  }
  return w;
}

template <class FA, class FB>
void pairs(const char* what, double units, FA fa, FB fb, const std::vector<float>& ya, const std::vector<float>& yb) {
  std::vector<double> ta, tb, ratio;
  for (int r = 0; r < PAIRS; ++r) {
    const auto t0 = Clock::now();
    fa();
    const auto t1 = Clock::now();
    fb();
    const auto t2 = Clock::now();
    ta.push_back(std::chrono::duration<double>(t1 - t0).count());
    tb.push_back(std::chrono::duration<double>(t2 - t1).count());
    ratio.push_back(tb.back() / ta.back());
  }
  std::sort(ta.begin(), ta.end());
  std::sort(tb.begin(), tb.end());
  std::sort(ratio.begin(), ratio.end());
  const bool same = std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float)) == 0;
  std::printf("| %s | %.2f | %.2f | %.3f (%.3f-%.3f) | %s |\n", what, ta[0] * 2.75e9 / units, tb[0] * 2.75e9 / units,
              ratio[PAIRS / 2], ratio[PAIRS / 4], ratio[3 * PAIRS / 4], same ? "yes" : "**no**");
}

#ifdef __AVX2__
template <auto QA, auto QB, int BB, bool Q41>
void q8(const char* name, int64_t m, int64_t n, int64_t k) {
  const int64_t nb = k / 32;
  const auto w = blocks(n, nb, BB, Q41);
  std::mt19937 rng(2);
  std::vector<float> x(m * k), ya(m * n), yb(m * n);
  for (auto& v : x) v = static_cast<float>(static_cast<int>(rng() % 20001) - 10000) * 1e-4f;
  const auto la = vA::lanes_of<QA, 8>(x.data(), m, nb);
  const auto lb = vB::lanes_of<QB, 8>(x.data(), m, nb);
  const int reps = static_cast<int>(std::max<int64_t>(1, 60000000 / (n * k * m)));
  char what[96];
  std::snprintf(what, sizeof what, "q8 %s, %ld rows, %ld x %ld", name, m, n, k);
  pairs(what, reps * n * nb * (m / 8.0),
        [&] { for (int i = 0; i < reps; ++i) vA::rows_q8<QA, 8>(la, w.data(), ya.data(), m, nb, n, 0, n); },
        [&] { for (int i = 0; i < reps; ++i) vB::rows_q8<QB, 8>(lb, w.data(), yb.data(), m, nb, n, 0, n); }, ya, yb);
}
#endif

template <auto FA, auto FB, int MC, int BB, bool Q41>
void int16(const char* name, int64_t n, int64_t k) {
  const int64_t nb = k / 32;
  const auto w = blocks(n, nb, BB, Q41);
  std::mt19937 rng(3);
  std::vector<int16_t> xq(MC * k);
  for (auto& v : xq) v = static_cast<int16_t>(static_cast<int>(rng() % 65535) - 32767);
  std::vector<float> xs(MC * nb, 1e-3f), xsum(MC * nb, 0.5f), ya(MC * n), yb(MC * n);
  const int reps = static_cast<int>(std::max<int64_t>(2, 4000000 / (n * k)));
  char what[96];
  std::snprintf(what, sizeof what, "int16 %s, %d rows, %ld x %ld", name, MC, n, k);
  pairs(what, static_cast<double>(reps) * n * nb * MC,
        [&] { for (int i = 0; i < reps; ++i) FA(xq.data(), xs.data(), xsum.data(), w.data(), ya.data(), k, n, 0, n); },
        [&] { for (int i = 0; i < reps; ++i) FB(xq.data(), xs.data(), xsum.data(), w.data(), yb.data(), k, n, 0, n); },
        ya, yb);
}

#define Q(ns, t) ns::QType::t
int main() {
  std::printf("| kernel, shape | A cycles | B cycles | B/A median (quartiles) | bitwise equal |\n");
  std::printf("|---|---|---|---|---|\n");
#if defined(KERNEL_Q8) && defined(__AVX2__)
  for (int64_t m : {8, 16, 64}) {
    q8<Q(vA, Q4_0), Q(vB, Q4_0), 18, false>("Q4_0", m, 1024, 4096);
    q8<Q(vA, Q4_0), Q(vB, Q4_0), 18, false>("Q4_0", m, 256, 14336);
  }
  q8<Q(vA, Q4_1), Q(vB, Q4_1), 20, true>("Q4_1", 16, 1024, 4096);
  q8<Q(vA, Q4_1), Q(vB, Q4_1), 20, true>("Q4_1", 16, 576, 1536);
  q8<Q(vA, Q8_0), Q(vB, Q8_0), 34, false>("Q8_0", 16, 1024, 4096);
#endif
#ifdef KERNEL_INT16
#define I16(t, mc, bb, q41, n, k) \
  int16<vA::rows_int<Q(vA, t), mc>, vB::rows_int<Q(vB, t), mc>, mc, bb, q41>(#t, n, k)
  I16(Q4_1, 1, 20, true, 1024, 576);
  I16(Q4_1, 4, 20, true, 1024, 576);
  I16(Q4_1, 1, 20, true, 576, 1536);
  I16(Q4_1, 4, 20, true, 576, 1536);
  I16(Q8_0, 1, 34, false, 1024, 576);
  I16(Q8_0, 4, 34, false, 1024, 576);
  I16(Q4_0, 1, 18, false, 2048, 4096);
  I16(Q4_0, 4, 18, false, 2048, 4096);
#endif
}
"""


def kernels(text: str) -> str:
    """The kernel part of ``gguf_linear.cpp``'s text, its namespace closed."""
    start, end = text.index(START), text.index(END)
    return text[start:end] + "}  // namespace\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision of A (B is the working tree)")
    ap.add_argument("--kernels", default="q8,int16", help="q8, int16 or both")
    ap.add_argument("--pairs", type=int, default=31)
    args = ap.parse_args()
    if args.pairs < 4:
        raise ValueError(f"--pairs must be >= 4, got {args.pairs}")
    chosen = set(args.kernels.split(","))
    if not chosen or not chosen <= {"q8", "int16"}:
        raise ValueError(f"--kernels must name q8 and/or int16, got {args.kernels!r}")
    from torch.utils.cpp_extension import include_paths, library_paths

    from treeserve._cpp import _CFLAGS, INCLUDE
    from treeserve._cpu import cpu_features

    base = subprocess.run(["git", "show", f"{args.base}:{SOURCE}"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "a.inc").write_text(kernels(base))
        (d / "b.inc").write_text(kernels((ROOT / SOURCE).read_text()))
        (d / "ab.cpp").write_text(HARNESS.replace("PAIRS_N", str(args.pairs)))
        libs = library_paths()
        cmd = ["g++", *_CFLAGS, "-std=c++20", *(f"-D{'KERNEL_' + k.upper()}" for k in sorted(chosen)),
               *(f"-I{p}" for p in [*include_paths(), str(INCLUDE)]), str(d / "ab.cpp"), "-o", str(d / "ab"),
               *(f"-L{p}" for p in libs), "-ltorch", "-ltorch_cpu", "-lc10", *(f"-Wl,-rpath,{p}" for p in libs)]
        subprocess.run(cmd, check=True)
        cpu = cpu_features().describe()
        print(f"A = {args.base}, B = the working tree; {cpu}, one thread, {args.pairs} pairs each\n")
        subprocess.run([str(d / "ab")], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()

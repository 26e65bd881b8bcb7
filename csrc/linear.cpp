// Batch-invariant linear layer for the cpp backend of ops.linear (icqs_fast._C.linear):
//
//   out[m, n] = sum_k x[m, k] w[n, k]  (+ bias[n])
//
// with a reduction order per output element that depends only on K and the mode, never on M,
// on the row's place in the batch, on its neighbours or on the thread count. A library GEMM
// picks its kernel and its blocking by the row count (MKL's fp32 path differs at M <= 7, and at
// some M with 2 threads), so a row scored alone and inside a batch got different bits; here
// each output element is computed by one thread, in one fixed order, and a task always
// computes whole elements (padding rows are computed and dropped, never mixed in).
//
// The weight is packed once (linear_pack) into panels of 32 output columns:
//   kind 0 (fp32 products): [Np/32][K][32] fp32;
//   kind 1 (bf16 products): [Np/32][Kp/2][32][2] bf16, pairs of consecutive k per column
//     (the VNNI layout of the dot instructions and of AMX's B operand), Kp = K rounded up to 32.
// Rows past N and k past K are zero.
//
// Modes (the products):
//   0  fp32: per element, one fused multiply-add per k in increasing k (a chain of K FMAs, then
//      + bias). The AVX-512, AVX2 and generic paths run that chain exactly: the same bits on
//      every ISA level.
//   1  bf16 products: x rounded to bf16 (round to nearest even), w bf16, fp32 accumulation.
//   2, 3  x split into 2 or 3 bf16 terms (hi, mid, lo: each the rounding of what the previous
//      ones left; 3 terms hold any fp32 exactly, so every product is exact and only the fp32
//      accumulation rounds). One accumulator per element takes term after term.
//   AVX-512 BF16: per k pair, _mm512_dpbf16_ps (odd element's product, then even's, in order).
//   AVX2 / generic: the same two steps widened to fp32 (a product of two bf16 is exact in fp32,
//   so this is the dot instruction's chain; subnormals aside, the same bits).
//   AMX (isa 3): x's bf16 rows as tile A, the packed panel as tile B, 2 x 2 tiles of 16 x 16
//   outputs; the tile unit's own fixed order per element, K chunk after K chunk.
//
// No torch headers: Python passes raw pointers and element strides (unit last-dim strides).

#include <pybind11/pybind11.h>

#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && !defined(ICQS_FAST_GENERIC_ONLY)
#include <immintrin.h>
#define ICQS_LIN_X86 1
#endif

namespace py = pybind11;

#pragma GCC diagnostic ignored "-Wpsabi"

// Defined in rowwise.cpp: ops.silu_mul's row function at an ISA level (-1 the CPU's best,
// else 0-2), for the gated product's epilogue.
using SiluRowFn = void (*)(const float*, const float*, float*, int64_t);
SiluRowFn silu_row_at(int isa);
// Defined in rotary.cpp: ops.rotary's arithmetic on one row at an ISA level (-1 the CPU's
// best, else 0-2), for the rotary epilogue.
using RotaryRowFn = void (*)(const float*, const float*, const float*, float*, int64_t);
RotaryRowFn rotary_row_at(int isa);
// Defined below: a row rounded to bf16 as a bf16-products x is.
void bf16_round_row(const float* src, int64_t n, uint16_t* dst, int isa);

namespace {

constexpr int64_t kNR = 32;  // output columns per packed panel
constexpr int64_t kKC = 32;  // bf16 K chunk (one AMX tile row)
constexpr int64_t kTaskRows = 96, kTaskCols = 256;  // one task's output block

enum Mode : int { kF32 = 0, kBF16 = 1, kBF16x2 = 2, kBF16x3 = 3 };
enum WType : int { kWF32 = 0, kWBF16 = 2 };

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

inline uint16_t bf16_rne(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Elements [k0, K) of x's row as `terms` bf16 terms (dst[t * Kp + k]), each the rounding of
// what the previous ones left.
inline void bf16_terms(const float* xr, int64_t k0, int64_t K, int terms, int64_t Kp,
                       uint16_t* dst) {
    for (int64_t k = k0; k < K; ++k) {
        float r = xr[k];
        for (int t = 0; t < terms; ++t) {
            const uint16_t h = bf16_rne(r);
            dst[t * Kp + k] = h;
            r -= bf16_to_f32(h);  // exact: what this term left for the next
        }
    }
}

struct Args {
    const float* x;        // [M, K] fp32, row stride xs (modes 0)
    int64_t xs;
    int64_t M, K, N, Kp;
    const float* pf;       // packed fp32 panels (mode 0)
    const uint16_t* pb;    // packed bf16 panels (modes 1-3)
    const float* bias;
    float* out;
    int64_t os;
    int terms;             // bf16 terms of x (modes 1-3)
    const uint16_t* xb;    // x's terms, bf16: [Mp][terms][Kp], rows past M zero
    int64_t xbs;           // its row stride: terms * Kp (x's own for a bf16 x read in place)
    const uint16_t* xt;    // rows from mt on (a bf16 x read in place: its last partial block,
    int64_t mt;            // zero-padded to whole AMX blocks), stride xbs; else mt = Mp
    const float* res;      // [M, N] added to the output last (row stride rs), or null
    int64_t rs;
    // Rotary position embedding of each rd-wide head of the output (rd 0: none): row m is
    // token m % rt of batch m / rt, its cos / sin rows at rc / rsn + b * rbs + t * rts.
    const float *rc, *rsn;
    int64_t rd, rt, rbs, rts;
    RotaryRowFn rotary_row;  // rotary_row_at's, at the call's ISA level
};

// The output block's heads rotated in place by ops.rotary's own row code, so its bits.
void rotate_block(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t m = m0; m < m1; ++m) {
        const int64_t b = m / a.rt, t = m % a.rt;
        const float* c = a.rc + b * a.rbs + t * a.rts;
        const float* sn = a.rsn + b * a.rbs + t * a.rts;
        for (int64_t h = n0; h < n1; h += a.rd) {
            float* o = a.out + m * a.os + h;
            a.rotary_row(o, c, sn, o, a.rd / 2);  // in place: it reads each pair first
        }
    }
}

// out += res over a task's block (after the kernel wrote it): out = (sum + bias) + res, the
// bits of torch's res + (x @ w^T + bias), read while the block is still in cache.
void add_residual(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t m = m0; m < m1; ++m) {
        float* o = a.out + m * a.os;
        const float* r = a.res + m * a.rs;
        for (int64_t n = n0; n < n1; ++n) o[n] = r[n] + o[n];
    }
}

inline float finish(const Args& a, float acc, int64_t n) {
    return a.bias != nullptr ? acc + a.bias[n] : acc;
}

// ---- generic paths (any CPU): the reference chains, element by element ------------------------

void f32_generic(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = n0; n < n1; ++n) {
            const float* panel = a.pf + (n / kNR) * a.K * kNR + n % kNR;
            const float* xr = a.x + m * a.xs;
            float acc = 0.f;
            for (int64_t k = 0; k < a.K; ++k) acc = std::fma(xr[k], panel[k * kNR], acc);
            a.out[m * a.os + n] = finish(a, acc, n);
        }
}

void bf16_generic(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = n0; n < n1; ++n) {
            const uint16_t* panel = a.pb + (n / kNR) * a.Kp * kNR + (n % kNR) * 2;
            float acc = 0.f;
            for (int t = 0; t < a.terms; ++t) {
                const uint16_t* xr = a.xb + m * a.xbs + t * a.Kp;
                for (int64_t kp = 0; kp < a.Kp / 2; ++kp) {
                    const uint16_t* wp = panel + kp * kNR * 2;
                    acc = std::fma(bf16_to_f32(xr[2 * kp + 1]), bf16_to_f32(wp[1]), acc);
                    acc = std::fma(bf16_to_f32(xr[2 * kp]), bf16_to_f32(wp[0]), acc);
                }
            }
            a.out[m * a.os + n] = finish(a, acc, n);
        }
}

#ifdef ICQS_LIN_X86

// ---- AVX2 (x86-64-v3): register tile of 2 rows x 32 columns (4 x 8 lanes) ---------------------

#define V3 __attribute__((target("arch=x86-64-v3")))

V3 inline void store_v3(const Args& a, int64_t m, int64_t n, int nc, __m256 v0, __m256 v1, __m256 v2,
                        __m256 v3) {
    alignas(32) float buf[32];
    _mm256_store_ps(buf, v0);
    _mm256_store_ps(buf + 8, v1);
    _mm256_store_ps(buf + 16, v2);
    _mm256_store_ps(buf + 24, v3);
    for (int j = 0; j < nc; ++j) a.out[m * a.os + n + j] = finish(a, buf[j], n + j);
}

V3 void f32_v3(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += kNR) {
        const int nc = static_cast<int>(std::min<int64_t>(kNR, n1 - n));
        const float* panel = a.pf + (n / kNR) * a.K * kNR;
        for (int64_t m = m0; m < m1; m += 2) {
            const int64_t m2 = std::min(m + 1, m1 - 1);  // a lone last row is computed twice
            const float* x0 = a.x + m * a.xs;
            const float* x1 = a.x + m2 * a.xs;
            __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
            __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00;
            for (int64_t k = 0; k < a.K; ++k) {
                const float* b = panel + k * kNR;
                const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
                const __m256 b2 = _mm256_loadu_ps(b + 16), b3 = _mm256_loadu_ps(b + 24);
                const __m256 a0 = _mm256_broadcast_ss(x0 + k), a1 = _mm256_broadcast_ss(x1 + k);
                c00 = _mm256_fmadd_ps(a0, b0, c00);
                c01 = _mm256_fmadd_ps(a0, b1, c01);
                c02 = _mm256_fmadd_ps(a0, b2, c02);
                c03 = _mm256_fmadd_ps(a0, b3, c03);
                c10 = _mm256_fmadd_ps(a1, b0, c10);
                c11 = _mm256_fmadd_ps(a1, b1, c11);
                c12 = _mm256_fmadd_ps(a1, b2, c12);
                c13 = _mm256_fmadd_ps(a1, b3, c13);
            }
            store_v3(a, m, n, nc, c00, c01, c02, c03);
            if (m + 1 < m1) store_v3(a, m + 1, n, nc, c10, c11, c12, c13);
        }
    }
}

// A packed pair vector (8 columns' pairs) widened: odd elements (high halves) and even ones.
V3 inline void widen_v3(__m256i p, __m256& odd, __m256& even) {
    odd = _mm256_castsi256_ps(_mm256_and_si256(p, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
}

V3 void bf16_v3(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += kNR) {
        const int nc = static_cast<int>(std::min<int64_t>(kNR, n1 - n));
        const uint16_t* panel = a.pb + (n / kNR) * a.Kp * kNR;
        for (int64_t m = m0; m < m1; ++m) {
            __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
            for (int t = 0; t < a.terms; ++t) {
                const uint16_t* xr = a.xb + m * a.xbs + t * a.Kp;
                for (int64_t kp = 0; kp < a.Kp / 2; ++kp) {
                    const __m256i* b = reinterpret_cast<const __m256i*>(panel + kp * kNR * 2);
                    const __m256 x1 = _mm256_set1_ps(bf16_to_f32(xr[2 * kp + 1]));
                    const __m256 x0 = _mm256_set1_ps(bf16_to_f32(xr[2 * kp]));
                    __m256 o, e;
                    widen_v3(_mm256_loadu_si256(b), o, e);
                    c0 = _mm256_fmadd_ps(x0, e, _mm256_fmadd_ps(x1, o, c0));
                    widen_v3(_mm256_loadu_si256(b + 1), o, e);
                    c1 = _mm256_fmadd_ps(x0, e, _mm256_fmadd_ps(x1, o, c1));
                    widen_v3(_mm256_loadu_si256(b + 2), o, e);
                    c2 = _mm256_fmadd_ps(x0, e, _mm256_fmadd_ps(x1, o, c2));
                    widen_v3(_mm256_loadu_si256(b + 3), o, e);
                    c3 = _mm256_fmadd_ps(x0, e, _mm256_fmadd_ps(x1, o, c3));
                }
            }
            store_v3(a, m, n, nc, c0, c1, c2, c3);
        }
    }
}

// ---- AVX-512 (x86-64-v4): register tile of 12 rows x 32 columns (2 x 16 lanes) ----------------

#define V4 __attribute__((target("arch=x86-64-v4")))
#define V4BF __attribute__((target("arch=x86-64-v4,avx512bf16")))
constexpr int kMR4 = 12;

V4 inline void store_v4(const Args& a, int64_t m, int64_t n, int nc, __m512 lo, __m512 hi) {
    float* o = a.out + m * a.os + n;
    if (a.bias != nullptr) {
        const __mmask16 ml = nc >= 16 ? __mmask16(0xffff) : __mmask16((1u << nc) - 1u);
        const __mmask16 mh = nc >= 32 ? __mmask16(0xffff)
                                      : nc <= 16 ? __mmask16(0) : __mmask16((1u << (nc - 16)) - 1u);
        lo = _mm512_add_ps(lo, _mm512_maskz_loadu_ps(ml, a.bias + n));
        hi = _mm512_add_ps(hi, _mm512_maskz_loadu_ps(mh, a.bias + n + 16));
        _mm512_mask_storeu_ps(o, ml, lo);
        _mm512_mask_storeu_ps(o + 16, mh, hi);
        return;
    }
    if (nc == 32) {
        _mm512_storeu_ps(o, lo);
        _mm512_storeu_ps(o + 16, hi);
        return;
    }
    const __mmask16 ml = nc >= 16 ? __mmask16(0xffff) : __mmask16((1u << nc) - 1u);
    const __mmask16 mh = nc <= 16 ? __mmask16(0) : __mmask16((1u << (nc - 16)) - 1u);
    _mm512_mask_storeu_ps(o, ml, lo);
    _mm512_mask_storeu_ps(o + 16, mh, hi);
}

V4 void f32_v4(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t m = m0; m < m1; m += kMR4) {
        const int mc = static_cast<int>(std::min<int64_t>(kMR4, m1 - m));
        const float* xr[kMR4];
        for (int i = 0; i < kMR4; ++i) xr[i] = a.x + (m + std::min(i, mc - 1)) * a.xs;
        for (int64_t n = n0; n < n1; n += kNR) {
            const int nc = static_cast<int>(std::min<int64_t>(kNR, n1 - n));
            const float* panel = a.pf + (n / kNR) * a.K * kNR;
            __m512 lo[kMR4], hi[kMR4];
            for (int i = 0; i < kMR4; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
            for (int64_t k = 0; k < a.K; ++k) {
                const __m512 b0 = _mm512_loadu_ps(panel + k * kNR);
                const __m512 b1 = _mm512_loadu_ps(panel + k * kNR + 16);
                for (int i = 0; i < kMR4; ++i) {
                    const __m512 av = _mm512_set1_ps(xr[i][k]);
                    lo[i] = _mm512_fmadd_ps(av, b0, lo[i]);
                    hi[i] = _mm512_fmadd_ps(av, b1, hi[i]);
                }
            }
            for (int i = 0; i < mc; ++i) store_v4(a, m + i, n, nc, lo[i], hi[i]);
        }
    }
}

V4BF void bf16_dot_v4(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t m = m0; m < m1; m += kMR4) {
        const int mc = static_cast<int>(std::min<int64_t>(kMR4, m1 - m));
        for (int64_t n = n0; n < n1; n += kNR) {
            const int nc = static_cast<int>(std::min<int64_t>(kNR, n1 - n));
            const uint16_t* panel = a.pb + (n / kNR) * a.Kp * kNR;
            __m512 lo[kMR4], hi[kMR4];
            for (int i = 0; i < kMR4; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
            for (int t = 0; t < a.terms; ++t) {
                const uint32_t* xr[kMR4];
                for (int i = 0; i < kMR4; ++i)
                    xr[i] = reinterpret_cast<const uint32_t*>(a.xb + (m + std::min(i, mc - 1)) * a.xbs +
                                                              t * a.Kp);
                for (int64_t kp = 0; kp < a.Kp / 2; ++kp) {
                    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + kp * kNR * 2);
                    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + kp * kNR * 2 + 32);
                    for (int i = 0; i < kMR4; ++i) {
                        const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[i][kp]));
                        lo[i] = _mm512_dpbf16_ps(lo[i], av, b0);
                        hi[i] = _mm512_dpbf16_ps(hi[i], av, b1);
                    }
                }
            }
            for (int i = 0; i < mc; ++i) store_v4(a, m + i, n, nc, lo[i], hi[i]);
        }
    }
}

// ---- AMX (tiles) -------------------------------------------------------------------------------

#define AMX __attribute__((target("arch=x86-64-v4,amx-tile,amx-bf16")))

// Blocks of 32 rows x 32 columns: tiles 0-3 the outputs, 4-5 x's rows (A: 16 rows x 32 k),
// 6-7 the panel's two halves (B: 16 k pairs x 16 columns' pairs, 128 bytes apart).
AMX void bf16_amx(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    amx_config_16x64();
    alignas(64) float c[32][32];
    const int64_t xstride = a.xbs * 2;  // bytes between x rows
    // Panel by panel, the task's row blocks inside: the panel (36 KB at K = 576) stays in L1
    // while they run.
    for (int64_t n = n0; n < n1; n += kNR) {
        const int64_t nc = std::min<int64_t>(kNR, n1 - n);
        const uint16_t* panel = a.pb + (n / kNR) * a.Kp * kNR;
        for (int64_t m = m0; m < m1; m += 32) {
            const int64_t mc = std::min<int64_t>(32, m1 - m);
            // Rows up to Mp exist (zero past M): x's terms, or a bf16 x and its padded tail.
            const uint16_t* x0 = m < a.mt ? a.xb + m * a.xbs : a.xt + (m - a.mt) * a.xbs;
            const uint16_t* x1 = x0 + 16 * a.xbs;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int t = 0; t < a.terms; ++t) {
                for (int64_t k0 = 0; k0 < a.Kp; k0 += kKC) {
                    const uint16_t* b = panel + (k0 / 2) * kNR * 2;
                    _tile_loadd(4, x0 + t * a.Kp + k0, xstride);
                    _tile_loadd(5, x1 + t * a.Kp + k0, xstride);
                    _tile_loadd(6, b, kNR * 4);
                    _tile_loadd(7, b + 32, kNR * 4);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            if (mc == 32 && nc == 32 && a.bias == nullptr) {
                float* o = a.out + m * a.os + n;
                _tile_stored(0, o, a.os * 4);
                _tile_stored(1, o + 16, a.os * 4);
                _tile_stored(2, o + 16 * a.os, a.os * 4);
                _tile_stored(3, o + 16 * a.os + 16, a.os * 4);
                continue;
            }
            _tile_stored(0, &c[0][0], 128);
            _tile_stored(1, &c[0][16], 128);
            _tile_stored(2, &c[16][0], 128);
            _tile_stored(3, &c[16][16], 128);
            for (int64_t i = 0; i < mc; ++i)
                store_v4(a, m + i, n, static_cast<int>(nc), _mm512_load_ps(&c[i][0]),
                         _mm512_load_ps(&c[i][16]));
        }
    }
    _tile_release();
}

// x's row as `terms` bf16 terms (dst[t * Kp + k]), 16 elements a step: the same integer
// rounding as bf16_rne (so the same bits as bf16_terms, NaN included) and the same fp32
// subtraction for what a term leaves to the next. Elements past K are left to the caller.
__attribute__((target("arch=x86-64-v4"))) void bf16_terms_v4(const float* xr, int64_t K,
                                                             int terms, int64_t Kp,
                                                             uint16_t* dst) {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 r = _mm512_loadu_ps(xr + k);
        for (int t = 0; t < terms; ++t) {
            const __m512i h = bf16_rne16(r);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * Kp + k),
                                _mm512_cvtepi32_epi16(h));
            r = _mm512_sub_ps(r, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
        }
    }
    bf16_terms(xr, k, K, terms, Kp, dst);
}

bool has_bf16_dot() {
    static const bool ok = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
    return ok;
}

bool has_amx() { return cpu_has_amx(); }

#endif  // ICQS_LIN_X86

int best_level() {
#ifdef ICQS_LIN_X86
    if (has_amx()) return 3;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

using Fn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t);

// The kernel for a mode at (at most) an ISA level, and the level it runs: AMX and the dot
// instruction only for bf16 products, the dot instruction only where the CPU has it.
std::pair<Fn, int> pick(int mode, int level) {
#ifdef ICQS_LIN_X86
    if (mode == kF32) {
        if (level >= 2) return {f32_v4, 2};
        if (level == 1) return {f32_v3, 1};
        return {f32_generic, 0};
    }
    if (level >= 3) return {bf16_amx, 3};
    if (level >= 2 && has_bf16_dot()) return {bf16_dot_v4, 2};
    if (level >= 1) return {bf16_v3, 1};
#endif
    return {mode == kF32 ? f32_generic : bf16_generic, 0};
}

int64_t packed_size(int64_t N, int64_t K, int kind) {
    const int64_t Np = round_up(N, kNR);
    return kind == 0 ? Np * K : Np * round_up(K, kKC);
}

void linear_pack(uintptr_t w, int64_t ws, int wt, int64_t N, int64_t K, int kind, uintptr_t out) {
    if (N < 1 || K < 1) throw std::invalid_argument("linear_pack: N and K must be >= 1");
    if (wt != kWF32 && wt != kWBF16) throw std::invalid_argument("linear_pack: w_dtype 0 or 2");
    if (kind != 0 && kind != 1) throw std::invalid_argument("linear_pack: kind 0 or 1");
    const float* wf = reinterpret_cast<const float*>(w);
    const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
    const int64_t Np = round_up(N, kNR), Kp = round_up(K, kKC);
    py::gil_scoped_release nogil;
    if (kind == 0) {
        float* o = reinterpret_cast<float*>(out);
        for (int64_t n = 0; n < Np; ++n)
            for (int64_t k = 0; k < K; ++k)
                o[(n / kNR) * K * kNR + k * kNR + n % kNR] =
                    n >= N ? 0.f : wt == kWF32 ? wf[n * ws + k] : bf16_to_f32(wb[n * ws + k]);
        return;
    }
    uint16_t* o = reinterpret_cast<uint16_t*>(out);
    for (int64_t n = 0; n < Np; ++n)
        for (int64_t k = 0; k < Kp; ++k)
            o[(n / kNR) * Kp * kNR + (k / 2) * kNR * 2 + (n % kNR) * 2 + (k & 1)] =
                n >= N || k >= K ? 0 : wt == kWBF16 ? wb[n * ws + k] : bf16_rne(wf[n * ws + k]);
}

// What the calling thread's kept buffer holds: x's terms for (M, K, mode), or nothing.
struct KeptTerms {
    int64_t M = -1, K = -1;
    int mode = -1;
};

bool linear(uintptr_t x, int64_t xs, int64_t M, int64_t K, uintptr_t packed, int64_t N,
            uintptr_t bias, uintptr_t out, int64_t os, int mode, int nthreads, int isa,
            bool reuse_x, uintptr_t up, uintptr_t res, int64_t rs, bool x_bf16, bool out_bf16,
            uintptr_t rot_cos, uintptr_t rot_sin, int64_t rot_dim, int64_t rot_tokens,
            int64_t rot_bstride, int64_t rot_tstride) {
    if (M < 0 || K < 1 || N < 1) throw std::invalid_argument("linear: bad shape");
    if (mode < kF32 || mode > kBF16x3) throw std::invalid_argument("linear: mode must be 0-3");
    if (up != 0 && (bias != 0 || res != 0))
        throw std::invalid_argument("linear: a gated product takes no bias and no residual");
    if (res != 0 && rs < N) throw std::invalid_argument("linear: residual row stride >= N");
    if (x_bf16 && mode != kBF16)
        throw std::invalid_argument("linear: a bf16 x only with bf16 products (mode 1)");
    if (out_bf16 && up == 0)
        throw std::invalid_argument("linear: a bf16 output only for a gated product");
    if (xs < K || os < N) throw std::invalid_argument("linear: row strides >= K and >= N");
    if (rot_dim != 0 &&
        (up != 0 || res != 0 || rot_cos == 0 || rot_sin == 0 || rot_dim < 2 || rot_dim % 2 ||
         kTaskCols % rot_dim || N % rot_dim || rot_tokens < 1 || M % rot_tokens))
        throw std::invalid_argument(
            "linear: a rotary epilogue takes no up and no residual, cos and sin, an even head "
            "size dividing N and 256, and M a multiple of its tokens");
    if (M == 0) return false;
    const int best = best_level();
    const auto [fn, ran] = pick(mode, isa < 0 ? best : std::min(isa, best));
    Args a{};
    a.x = reinterpret_cast<const float*>(x);
    a.xs = xs, a.M = M, a.K = K, a.N = N, a.Kp = round_up(K, kKC);
    a.pf = reinterpret_cast<const float*>(packed);
    a.pb = reinterpret_cast<const uint16_t*>(packed);
    a.bias = bias ? reinterpret_cast<const float*>(bias) : nullptr;
    a.out = reinterpret_cast<float*>(out);
    a.os = os;
    a.terms = mode;
    a.xbs = mode * a.Kp;
    a.res = res ? reinterpret_cast<const float*>(res) : nullptr;
    a.rs = rs;
    a.rc = reinterpret_cast<const float*>(rot_cos);
    a.rsn = reinterpret_cast<const float*>(rot_sin);
    a.rd = rot_dim, a.rt = rot_tokens, a.rbs = rot_bstride, a.rts = rot_tstride;
    a.rotary_row = rot_dim != 0 ? rotary_row_at(isa < 0 ? -1 : std::min(isa, cpu_isa_level()))
                                : nullptr;
    if (nthreads < 1) nthreads = 1;
    py::gil_scoped_release nogil;
    // x's bf16 terms once per call, rows padded to whole AMX blocks with zeros. The buffer is
    // the calling thread's, kept between calls up to kKeepBytes: a fresh one per call cost its
    // page faults (a fifth of a 640-row call's time in a probe).
    constexpr size_t kKeepBytes = size_t{16} << 20;
    // reuse_x: the caller vouches that x is the very input of this thread's previous call (the
    // q / k / v and gate / up projections share theirs), so the terms kept from it are x's
    // terms; they are used only when they were made for the same M, K and mode.
    static thread_local AlignedVec<uint16_t> kept;
    static thread_local KeptTerms kept_for;
    AlignedVec<uint16_t> fresh;
    bool reused = false;
    a.mt = round_up(M, 32);
    const uint16_t* x16 = reinterpret_cast<const uint16_t*>(x);
    if (x_bf16 && K % kKC == 0) {
        // A bf16 x is its own (only) term: read in place, rows past the last whole block of 32
        // from a zero-padded copy of them (AMX loads whole blocks).
        static thread_local AlignedVec<uint16_t> tail;
        a.xb = x16;
        a.xbs = xs;
        a.mt = M / 32 * 32;
        if (a.mt < M) {
            if (tail.size() < static_cast<size_t>(32 * xs)) tail.resize(32 * xs);
            std::memset(tail.data(), 0, static_cast<size_t>(32 * xs) * 2);
            for (int64_t m = a.mt; m < M; ++m)
                std::memcpy(tail.data() + (m - a.mt) * xs, x16 + m * xs, static_cast<size_t>(K) * 2);
            a.xt = tail.data();
        }
        kept_for = KeptTerms{};
    } else if (mode != kF32) {
        const int64_t Mp = round_up(M, 32);
        const size_t need = static_cast<size_t>(Mp * a.xbs);
        const bool keep = need * 2 <= kKeepBytes;
        AlignedVec<uint16_t>& xb = keep ? kept : fresh;
        reused = reuse_x && !x_bf16 && keep && kept_for.M == M && kept_for.K == K &&
                 kept_for.mode == mode;
        if (!reused && keep) kept_for = KeptTerms{};  // overwritten below
        if (xb.size() < need) xb.resize(need);
        uint16_t* base = xb.data();
        a.xb = base;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 64 && nthreads > 1 && !reused)
        for (int64_t m = 0; m < (reused ? 0 : Mp); ++m) {
            uint16_t* dst = base + m * a.xbs;
            if (m >= M) {
                std::memset(dst, 0, static_cast<size_t>(a.xbs) * 2);
                continue;
            }
            if (x_bf16) {  // already its bf16 term (K not a whole number of AMX rows)
                std::memcpy(dst, x16 + m * xs, static_cast<size_t>(K) * 2);
                std::memset(dst + K, 0, static_cast<size_t>(a.Kp - K) * 2);
                continue;
            }
            const float* xr = a.x + m * a.xs;
#ifdef ICQS_LIN_X86
            if (ran >= 2)  // the AVX-512 kernels' CPU (the same bits either way)
                bf16_terms_v4(xr, K, a.terms, a.Kp, dst);
            else
#endif
                bf16_terms(xr, 0, K, a.terms, a.Kp, dst);
            for (int t = 0; t < a.terms; ++t)
                std::memset(dst + t * a.Kp + K, 0, static_cast<size_t>(a.Kp - K) * 2);
        }
        // A bf16 x's copy is not its fp32 terms' (no reuse_x for it).
        if (keep) kept_for = x_bf16 ? KeptTerms{} : KeptTerms{M, K, mode};
    }
    const int64_t rb = (M + kTaskRows - 1) / kTaskRows, cb = (N + kTaskCols - 1) / kTaskCols;
    const int64_t tasks = rb * cb;
    // Dynamic tasks: a descheduled thread on a shared machine does not hold up the rest. A task
    // computes whole output elements, so the split never changes a sum. Column block outer:
    // consecutive tasks read the same weight panels (from the cache), where row block outer
    // had each task fetch another block's; the embedded model's 7 projections x 30 layers at
    // 500 rows went from 1,330-1,390 to 1,470-1,580 GFLOP/s (2 threads, alternated).
    if (up == 0) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (tasks > 1 && nthreads > 1)
        for (int64_t it = 0; it < tasks; ++it) {
            const int64_t c = it / rb, r = it % rb;
            const int64_t m0 = r * kTaskRows, m1 = std::min(M, (r + 1) * kTaskRows);
            const int64_t n0 = c * kTaskCols, n1 = std::min(N, (c + 1) * kTaskCols);
            fn(a, m0, m1, n0, n1);
            if (a.res != nullptr) add_residual(a, m0, m1, n0, n1);
            if (a.rd != 0) rotate_block(a, m0, m1, n0, n1);  // while the block is in cache
        }
        return reused;
    }
    // Gated: out = silu(x @ packed^T) * (x @ up^T). Each task computes its block of both
    // products into the thread's scratch (the same kernels, so the same sums), then the
    // epilogue writes the gated block: the two [M, N] products never reach memory.
    // ops.silu_mul's row function at the ISA level it takes (the same bits as the two
    // products then silu_mul).
    const SiluRowFn silu = silu_row_at(isa < 0 ? -1 : std::min(isa, cpu_isa_level()));
    const uint16_t* up_pb = reinterpret_cast<const uint16_t*>(up);
    const float* up_pf = reinterpret_cast<const float*>(up);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (tasks > 1 && nthreads > 1)
    for (int64_t it = 0; it < tasks; ++it) {
        static thread_local AlignedVec<float> scratch;
        if (scratch.size() < static_cast<size_t>(2 * kTaskRows * kTaskCols))
            scratch.resize(2 * kTaskRows * kTaskCols);
        const int64_t c = it / rb, r = it % rb;
        const int64_t m0 = r * kTaskRows, m1 = std::min(M, (r + 1) * kTaskRows);
        const int64_t n0 = c * kTaskCols, n1 = std::min(N, (c + 1) * kTaskCols);
        float* sg = scratch.data();
        float* su = sg + kTaskRows * kTaskCols;
        Args t = a;
        t.os = kTaskCols;
        // The kernels write out[m * os + n]: shift the origin so that (m0, n0) lands on the
        // scratch's first element (address arithmetic in integers; it is never dereferenced
        // outside the block).
        const uintptr_t shift = static_cast<uintptr_t>(m0 * kTaskCols + n0) * sizeof(float);
        t.out = reinterpret_cast<float*>(reinterpret_cast<uintptr_t>(sg) - shift);
        fn(t, m0, m1, n0, n1);
        t.pb = up_pb, t.pf = up_pf;
        t.out = reinterpret_cast<float*>(reinterpret_cast<uintptr_t>(su) - shift);
        fn(t, m0, m1, n0, n1);
        for (int64_t m = m0; m < m1; ++m) {
            float* g = sg + (m - m0) * kTaskCols;
            if (!out_bf16) {
                silu(g, su + (m - m0) * kTaskCols, a.out + m * a.os + n0, n1 - n0);
                continue;
            }
            // bf16 out: the rounding the next product gives its x.
            silu(g, su + (m - m0) * kTaskCols, g, n1 - n0);
            bf16_round_row(g, n1 - n0, reinterpret_cast<uint16_t*>(out) + m * os + n0, ran);
        }
    }
    return reused;
}

const char* const kLevelNames[4] = {"generic", "avx2", "avx512", "amx"};

}  // namespace

// n fp32 values rounded to bf16 as linear rounds a bf16-products x (one term), at ISA level
// `isa` (-1 the CPU's best; the same bits at every level): for the passes that write a
// product's input in bf16 (the gated epilogue above, rowwise.cpp's norms), read in place.
void bf16_round_row(const float* src, int64_t n, uint16_t* dst, int isa) {
#ifdef ICQS_LIN_X86
    if ((isa < 0 || isa >= 2) && best_level() >= 2) {
        bf16_terms_v4(src, n, 1, n, dst);
        return;
    }
#endif
    (void)isa;
    bf16_terms(src, 0, n, 1, n, dst);
}

void register_linear(py::module_& m) {
    m.def("linear_packed_size", &packed_size, py::arg("N"), py::arg("K"), py::arg("kind"),
          "elements of linear_pack's output: kind 0 fp32 panels, kind 1 bf16 pair panels");
    m.def("linear_pack", &linear_pack, py::arg("w"), py::arg("w_stride"), py::arg("w_dtype"),
          py::arg("N"), py::arg("K"), py::arg("kind"), py::arg("out"),
          "pack w [N,K] (w_dtype 0 fp32, 2 bf16; row stride in elements) into out: kind 0 "
          "[Np/32][K][32] fp32 (mode 0), kind 1 [Np/32][Kp/2][32][2] bf16 (modes 1-3; fp32 "
          "weights rounded to nearest even)");
    m.def("linear", &linear, py::arg("x"), py::arg("x_stride"), py::arg("M"), py::arg("K"),
          py::arg("packed"), py::arg("N"), py::arg("bias"), py::arg("out"), py::arg("out_stride"),
          py::arg("mode"), py::arg("nthreads"), py::arg("isa") = -1, py::arg("reuse_x") = false,
          py::arg("up") = 0, py::arg("residual") = 0, py::arg("residual_stride") = 0,
          py::arg("x_bf16") = false, py::arg("out_bf16") = false, py::arg("rot_cos") = 0,
          py::arg("rot_sin") = 0, py::arg("rot_dim") = 0, py::arg("rot_tokens") = 1,
          py::arg("rot_bstride") = 0, py::arg("rot_tstride") = 0,
          "out [M,N] fp32 = x [M,K] fp32 @ w^T (+ bias [N] fp32; 0 = none) with w packed by "
          "linear_pack (kind 0 for mode 0, kind 1 for modes 1-3); row strides in elements. "
          "mode 0 fp32 products, 1 bf16 products, 2/3 x split into 2/3 bf16 terms. Each output "
          "element in one fixed order that depends on K and the mode only. isa: -1 best, else "
          "at most 0 generic, 1 avx2, 2 avx512, 3 amx. reuse_x: x is the previous call's input on "
          "this thread (its bf16 terms are reused when kept for the same M, K and mode). "
          "up: a second weight packed alike ([N,K]; 0 = none): out = silu(x @ w^T) * "
          "(x @ up^T), no bias. residual: [M,N] fp32 (0 = none) added last: out = (x @ w^T + "
          "bias) + residual. x_bf16: x is bf16 (mode 1 only; its own term, read in place when K is a "
          "multiple of 32). out_bf16: the gated output rounded to bf16 as x is (with up only). "
          "rot_dim (0 = none): each rot_dim-wide head of the output rotated as ops.rotary does, "
          "row m by the cos / sin rows of token m % rot_tokens of batch m / rot_tokens (row "
          "strides rot_bstride, rot_tstride; no up, no residual). "
          "Returns whether the terms were reused.");
    m.def("linear_level", [](int mode, int isa) {
        const int best = best_level();
        return pick(mode, isa < 0 ? best : std::min(isa, best)).second;
    }, py::arg("mode"), py::arg("isa") = -1,
          "the ISA level linear runs for a mode (0 generic, 1 avx2, 2 avx512, 3 amx)");
    m.def("linear_best_level", &best_level, "the best ISA level linear can use on this CPU");
    m.def("linear_level_name", [](int level) -> std::string {
        if (level < 0 || level > 3) throw std::invalid_argument("level must be 0-3");
        return kLevelNames[level];
    });
}

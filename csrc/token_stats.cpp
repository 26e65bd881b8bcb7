// One-pass per-row softmax state for the cpp backend (icqs_fast._C).
//
// For each row of logits z (fp32/fp16/bf16, unit column stride, arbitrary row stride) this
// computes the mergeable float64 state of icqs_fast/backends/state.py:
//   state[i] = [m, s0, s1, s2, n, u1, u2], counts[i] = [#{j != t: z_j > z_t}, #{j < t: z_j == z_t}]
// with x = z / T, m = max finite x, s_k = sum e^{x-m} (x-m)^k, u = x - K (K = per-row shift).
//
// No torch headers: Python passes raw data pointers, strides and sizes, and allocates the
// outputs. Rows are split over OpenMP threads; inside a row the work is done in blocks of
// kBlock elements with GCC vector extensions (16 float lanes), compiled for AVX-512, AVX2 and
// baseline x86-64 via target_clones and picked at load time, so the module runs on any x86-64.
//
// Per block: pass 1 reads (and converts) the block once into an L1-resident buffer while taking
// its max, the finite count, the rank/greedy counts and the u sums; if the max grew, the double
// accumulators are rescaled once; pass 2 accumulates e^{d}, e^{d} d, e^{d} d^2 (d = x - m <= 0)
// from the buffer in float, added to the double row totals at the end of the block.

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;

// The 64-byte vector helpers are always inlined, so no vector crosses a call boundary.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace {

constexpr int kLanes = 16;
constexpr int64_t kBlock = 2048;  // elements per block: 8 KiB of fp32, stays in L1

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

#define ICQS_INLINE inline __attribute__((always_inline))

ICQS_INLINE v16f splat(float a) { return v16f{} + a; }
ICQS_INLINE v16i splati(int32_t a) { return v16i{} + a; }

ICQS_INLINE v16f vmax(v16f a, v16f b) { return a > b ? a : b; }

// Portable IEEE half -> float on 16 lanes (normal, subnormal, zero, inf, NaN), branch-free.
ICQS_INLINE v16f half_to_float(v16u h) {
    const v16u sign = (h & 0x8000u) << 16;
    const v16u mag = h & 0x7fffu;
    const v16u expo = h & 0x7c00u;
    const v16u normal = (mag << 13) + ((127u - 15u) << 23);
    const v16u special = (mag << 13) | 0x7f800000u;  // inf / NaN keep their payload
    const v16f sub = __builtin_convertvector(mag, v16f) * splat(5.9604644775390625e-8f);  // 2^-24
    v16u out = expo == 0x7c00u ? special : normal;
    out = expo == 0u ? (v16u)sub : out;
    return (v16f)(out | sign);
}

// Load 16 logits starting at element j of a row as float; lanes at or past `valid` are NaN
// (NaN fails every comparison and counts as non-finite, so padding changes nothing).
template <int DT>
ICQS_INLINE v16f load16(const void* row, int64_t j, int64_t valid) {
    if (DT == kF32) {
        const float* p = static_cast<const float*>(row) + j;
        v16f z;
        if (valid >= kLanes) {
            std::memcpy(&z, p, sizeof(z));
        } else {
            z = splat(std::numeric_limits<float>::quiet_NaN());
            for (int64_t k = 0; k < valid; ++k) z[k] = p[k];
        }
        return z;
    } else {
        const uint16_t* p = static_cast<const uint16_t*>(row) + j;
        v16h raw;
        if (valid >= kLanes) {
            std::memcpy(&raw, p, sizeof(raw));
        } else {
            // Quiet NaN padding: 0x7fc0 in bf16, 0x7e00 in fp16.
            raw = v16h{} + (uint16_t)(DT == kBF16 ? 0x7fc0u : 0x7e00u);
            for (int64_t k = 0; k < valid; ++k) raw[k] = p[k];
        }
        const v16u h = __builtin_convertvector(raw, v16u);
        if (DT == kBF16) return (v16f)(h << 16);
        return half_to_float(h);
    }
}

template <int DT>
ICQS_INLINE float load1(const void* row, int64_t j) {
    return load16<DT>(row, j, 1)[0];
}

// e^d for d <= 0 (Cephes expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp);
// d < -87 (including the -100 that stands for -inf) gives exactly 0.
ICQS_INLINE v16f exp_neg(v16f d) {
    const v16f log2e = splat(1.44269504088896341f);
    const v16f magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    const v16f t = d * log2e + magic;
    const v16f nf = t - magic;
    const v16i n = (v16i)t - (v16i)magic;
    v16f r = d - nf * splat(0.693359375f);
    r = r - nf * splat(-2.12194440e-4f);
    v16f p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    const v16i n_safe = n < splati(-126) ? splati(-126) : n;
    const v16f scale = (v16f)((n_safe + 127) << 23);
    const v16f e = p * scale;
    return d < splat(-87.0f) ? splat(0.0f) : e;
}

struct Consts {
    v16f gthr, eqval, cz, inv_t;
};

struct Pass1 {
    v16f bmax;      // max of finite z
    v16i gtv, eqv;  // z > z_t, z == z_t (negated counts: masks are -1)
    v16i nv;        // finite count (negated)
    v8d u1v, u2v;   // sum u, sum u^2 with u = (z - cz) / T over finite entries
};

// Pass 1 over one block of bl elements: read (and convert) it once, store the finite values
// (-inf elsewhere) in buf, and accumulate max, counts and u sums.
template <int DT, bool EQ>
ICQS_INLINE void pass1(const void* row, int64_t b0, int64_t bl, const Consts& c, float* buf,
                       Pass1& a) {
    const v16f vninf = splat(-std::numeric_limits<float>::infinity());
    const int64_t nvec = (bl + kLanes - 1) / kLanes;
    for (int64_t k = 0; k < nvec; ++k) {
        const v16f z = load16<DT>(row, b0 + k * kLanes, bl - k * kLanes);
        const v16i fin = ((v16i)z & 0x7f800000) != 0x7f800000;
        a.gtv -= z > c.gthr;
        if (EQ) a.eqv -= z == c.eqval;
        a.nv -= fin;
        const v16f zf = fin ? z : vninf;
        a.bmax = vmax(a.bmax, zf);
        const v16f u = fin ? (z - c.cz) * c.inv_t : v16f{};
        // u sums in double: x - K can be large next to the spread of x (cancellation).
        const v8d ulo = __builtin_convertvector(
            __builtin_shufflevector(u, u, 0, 1, 2, 3, 4, 5, 6, 7), v8d);
        const v8d uhi = __builtin_convertvector(
            __builtin_shufflevector(u, u, 8, 9, 10, 11, 12, 13, 14, 15), v8d);
        a.u1v += ulo + uhi;
        a.u2v += ulo * ulo + uhi * uhi;
        std::memcpy(buf + k * kLanes, &zf, sizeof(zf));
    }
}

struct RowIn {
    const void* row;
    int64_t v;
    int64_t t;       // target column in this row (may lie outside [0, v))
    double z_t;      // target logit
    double shift;    // K, in x = z / T units
    double temp;
};

// The mode-independent row reduction: used for whole rows (token_stats) and for vocabulary
// blocks (reduce_block) alike, since both are "a row of logits plus a target index".
template <int DT>
ICQS_INLINE void reduce_row_impl(const RowIn& in, double* state, int64_t* counts) {
    const float inf = std::numeric_limits<float>::infinity();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inv_t = static_cast<float>(1.0 / in.temp);

    // Rank thresholds in float, exact against the float64 z_t: z_j > z_t <=> z_j > round_down(z_t)
    // for float z_j; z_j == z_t only if z_t is a float.
    float gthr = static_cast<float>(in.z_t);
    if (static_cast<double>(gthr) > in.z_t) gthr = std::nextafter(gthr, -inf);
    const float eqval = static_cast<double>(static_cast<float>(in.z_t)) == in.z_t
                            ? static_cast<float>(in.z_t) : nan;
    // u = x - K is computed as (z - cz) / T in float (cz = K * T rounded), then corrected by
    // delta = cz / T - K in double, so an offset between K and the logits costs no precision.
    double cz_d = in.shift * in.temp;
    float cz = std::isfinite(cz_d) && std::fabs(cz_d) < 3.0e38 ? static_cast<float>(cz_d) : 0.0f;
    const double delta = static_cast<double>(cz) / in.temp - in.shift;
    const int32_t t_lim = in.t < 0 ? 0 : (in.t > in.v ? static_cast<int32_t>(in.v)
                                                       : static_cast<int32_t>(in.t));

    const Consts c{splat(gthr), splat(eqval), splat(cz), splat(inv_t)};
    const v16f vninf = splat(-inf);

    double s0 = 0, s1 = 0, s2 = 0, su = 0, suu = 0;
    int64_t n_fin = 0, greater = 0, eq_before = 0;
    float zmax = -inf;  // running max of finite z (T > 0, so also of x)
    alignas(64) float buf[kBlock];

    for (int64_t b0 = 0; b0 < in.v; b0 += kBlock) {
        const int64_t bl = in.v - b0 < kBlock ? in.v - b0 : kBlock;
        const int64_t nvec = (bl + kLanes - 1) / kLanes;
        Pass1 acc{vninf, {}, {}, {}, {}, {}};
        // Equal-to-target entries count only before the target: whole blocks before it are
        // counted in the vector loop, the one block holding it by a scalar loop (an index mask
        // in the vector loop makes GCC scalarise it).
        if (b0 + bl <= t_lim) {
            pass1<DT, true>(in.row, b0, bl, c, buf, acc);
        } else {
            pass1<DT, false>(in.row, b0, bl, c, buf, acc);
            if (std::isfinite(eqval)) {
                // buf holds the block's finite values (-inf elsewhere): same answer, in L1.
                int64_t cnt = 0;
                for (int64_t j = 0; j < t_lim - b0; ++j) cnt += buf[j] == eqval;
                eq_before += cnt;
            } else {
                for (int64_t j = b0; j < t_lim; ++j) eq_before += load1<DT>(in.row, j) == eqval;
            }
        }
        const v16f bmax = acc.bmax;
        const v16i gtv = acc.gtv, eqv = acc.eqv, nv = acc.nv;
        const v8d u1v = acc.u1v, u2v = acc.u2v;
        float bm = -inf;
        for (int k = 0; k < kLanes; ++k) {
            bm = bmax[k] > bm ? bmax[k] : bm;
            greater += gtv[k];
            eq_before += eqv[k];
            n_fin += nv[k];
        }
        for (int k = 0; k < kLanes / 2; ++k) {
            su += u1v[k];
            suu += u2v[k];
        }
        if (!(bm > -inf)) continue;  // nothing finite in this block
        if (bm > zmax) {
            if (zmax > -inf) {
                // Rescale the accumulators to the new max once per block (as state.merge).
                const double dm = (static_cast<double>(zmax) - static_cast<double>(bm)) / in.temp;
                const double w = std::exp(dm);
                s2 = w * (s2 + 2 * dm * s1 + dm * dm * s0);
                s1 = w * (s1 + dm * s0);
                s0 = w * s0;
            }
            zmax = bm;
        }
        const v16f vm = splat(zmax), vinv = c.inv_t;
        v16f a0 = {}, a1 = {}, a2 = {};
        for (int64_t k = 0; k < nvec; ++k) {
            v16f zb;
            std::memcpy(&zb, buf + k * kLanes, sizeof(zb));
            // -inf (non-finite or padding) becomes -100: e = 0 and e * d = 0, never NaN.
            const v16f d = vmax((zb - vm) * vinv, splat(-100.0f));
            const v16f e = exp_neg(d);
            const v16f ed = e * d;
            a0 += e;
            a1 += ed;
            a2 += ed * d;
        }
        double b_0 = 0, b_1 = 0, b_2 = 0;
        for (int k = 0; k < kLanes; ++k) {
            b_0 += a0[k];
            b_1 += a1[k];
            b_2 += a2[k];
        }
        s0 += b_0;
        s1 += b_1;
        s2 += b_2;
    }
    // The target itself never counts as "greater" (it can differ from z_t in chunked mode).
    if (in.t >= 0 && in.t < in.v && load1<DT>(in.row, in.t) > gthr) --greater;

    const double nd = static_cast<double>(n_fin);
    state[0] = zmax > -inf ? static_cast<double>(zmax) / in.temp
                           : -std::numeric_limits<double>::infinity();
    state[1] = s0;
    state[2] = s1;
    state[3] = s2;
    state[4] = nd;
    state[5] = su + nd * delta;
    state[6] = suu + 2 * delta * su + nd * delta * delta;
    counts[0] = greater;
    counts[1] = eq_before;
}

// One clone per ISA level; the loader picks the best the CPU supports.
#define ICQS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

ICQS_CLONES __attribute__((noinline)) void reduce_row_f32(const RowIn& in, double* s, int64_t* c) {
    reduce_row_impl<kF32>(in, s, c);
}
ICQS_CLONES __attribute__((noinline)) void reduce_row_f16(const RowIn& in, double* s, int64_t* c) {
    reduce_row_impl<kF16>(in, s, c);
}
ICQS_CLONES __attribute__((noinline)) void reduce_row_bf16(const RowIn& in, double* s, int64_t* c) {
    reduce_row_impl<kBF16>(in, s, c);
}

void reduce_rows(uintptr_t z_ptr, int64_t row_stride, int64_t n, int64_t v, int dtype,
                 uintptr_t t_ptr, uintptr_t zt_ptr, uintptr_t shift_ptr, double temperature,
                 uintptr_t state_ptr, uintptr_t counts_ptr, int nthreads) {
    if (n < 0 || v < 0) throw std::invalid_argument("reduce_rows: n and v must be >= 0");
    if (v >= (int64_t(1) << 31) - kBlock)
        throw std::invalid_argument("reduce_rows: vocabulary size must be < 2^31");
    if (!(temperature > 0) || !std::isfinite(temperature))
        throw std::invalid_argument("reduce_rows: temperature must be finite and > 0");
    if (dtype != kF32 && dtype != kF16 && dtype != kBF16)
        throw std::invalid_argument("reduce_rows: dtype code must be 0 (fp32), 1 (fp16), 2 (bf16)");
    const size_t esize = dtype == kF32 ? 4 : 2;
    const char* z = reinterpret_cast<const char*>(z_ptr);
    const int64_t* t = reinterpret_cast<const int64_t*>(t_ptr);
    const double* zt = reinterpret_cast<const double*>(zt_ptr);
    const double* shift = reinterpret_cast<const double*>(shift_ptr);
    double* state = reinterpret_cast<double*>(state_ptr);
    int64_t* counts = reinterpret_cast<int64_t*>(counts_ptr);
    if (nthreads < 1) nthreads = 1;

    py::gil_scoped_release nogil;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n > 1 && nthreads > 1)
    for (int64_t i = 0; i < n; ++i) {
        RowIn in{z + static_cast<size_t>(i) * static_cast<size_t>(row_stride) * esize, v, t[i],
                 zt[i], shift[i], temperature};
        double* s = state + 7 * i;
        int64_t* c = counts + 2 * i;
        if (dtype == kF32) reduce_row_f32(in, s, c);
        else if (dtype == kF16) reduce_row_f16(in, s, c);
        else reduce_row_bf16(in, s, c);
    }
}

std::string simd_level() {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4 (AVX-512)";
    if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3 (AVX2+FMA)";
    return "x86-64 baseline (SSE2)";
}

int max_threads() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "icqs_fast C++/OpenMP CPU kernels (raw pointers in, no torch headers)";
    m.def("reduce_rows", &reduce_rows, py::arg("z_ptr"), py::arg("row_stride"), py::arg("n"),
          py::arg("v"), py::arg("dtype"), py::arg("t_ptr"), py::arg("zt_ptr"),
          py::arg("shift_ptr"), py::arg("temperature"), py::arg("state_ptr"),
          py::arg("counts_ptr"), py::arg("nthreads"),
          "Per-row softmax state [n,7] float64 and counts [n,2] int64 of a [n,v] logits array "
          "(row_stride in elements, unit column stride; dtype 0=fp32, 1=fp16, 2=bf16; t int64, "
          "zt/shift float64 per row). Writes into the given output buffers.");
    m.def("simd_level", &simd_level, "ISA level of the kernel clone this CPU runs");
    m.def("max_threads", &max_threads, "OpenMP's default thread count (1 without OpenMP)");
#ifdef _OPENMP
    m.attr("openmp") = true;
#else
    m.attr("openmp") = false;
#endif
}

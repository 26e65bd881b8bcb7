// One-pass per-row softmax state for the cpp backend (icqs_fast._C).
//
// For each row of logits z (fp32/fp16/bf16, unit column stride, arbitrary row stride) this
// computes the mergeable float64 state of icqs_fast/backends/state.py:
//   state[i] = [m, s0, s1, s2, n, u1, u2], counts[i] = [#{j != t: z_j > z_t}, #{j < t: z_j == z_t}]
// with x = z / T, m = max finite x, s_k = sum e^{x-m} (x-m)^k, u = x - K (K = per-row shift).
//
// No torch headers: Python passes raw data pointers, strides and sizes, and allocates the
// outputs. Rows are split over OpenMP threads; inside a row the work is done in blocks of
// kBlock elements with GCC vector extensions of the machine's native width: the kernel is a
// template on the width W, instantiated for AVX-512 (W = 16), AVX2+FMA (W = 8) and the build's
// baseline x86-64-v2 (W = 4) with per-function target attributes, and picked at run time from
// the CPU's features - so the module runs on any x86-64-v2 machine. (One wide type for all
// three does not work: GCC scalarises 512-bit vector selects on AVX2.)
//
// Per block: pass 1 reads (and converts) the block once into an L1-resident buffer while taking
// its max, the finite count, the rank/greedy counts and the u sums; if the max grew, the double
// accumulators are rescaled once; pass 2 accumulates e^{d}, e^{d} d, e^{d} d^2 (d = x - m <= 0)
// from the buffer in float, added to the double row totals at the end of the block.
//
// Soft-capping epilogue (ops.linear_token_stats' softcap): with tanh_scale = a > 0 pass 1 counts
// the rank/greedy comparisons on the logit z as loaded (z_t is the target's uncapped logit: tanh
// is increasing, so that is the order of the exact capped logits, with no ties made by rounding
// where the cap saturates), then replaces it by tanh(a z) for everything else (max, finite
// count, u sums, the buffer pass 2 reads); the block is still read once and never written back.
// The caller passes the capped target's x as the shift and the temperature divided by the cap.
// It is a template flag (SC): the default kernels are compiled exactly as without it.

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "simd_math.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;

// The vector helpers are always inlined, so no vector crosses a call boundary.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace {

constexpr int64_t kBlock = 2048;  // elements per block: 8 KiB of fp32, stays in L1

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum Isa : int { kIsaV2 = 0, kIsaV3 = 1, kIsaV4 = 2 };

#define ICQS_INLINE inline __attribute__((always_inline))

template <int W>
ICQS_INLINE typename V<W>::f vmax(typename V<W>::f a, typename V<W>::f b) {
    return a > b ? a : b;
}

// Portable IEEE half -> float (normal, subnormal, zero, inf, NaN), branch-free.
template <int W>
ICQS_INLINE typename V<W>::f half_to_float(typename V<W>::u h) {
    using U = typename V<W>::u;
    using F = typename V<W>::f;
    const U sign = (h & 0x8000u) << 16;
    const U mag = h & 0x7fffu;
    const U expo = h & 0x7c00u;
    const U normal = (mag << 13) + ((127u - 15u) << 23);
    const U special = (mag << 13) | 0x7f800000u;  // inf / NaN keep their payload
    const F sub = __builtin_convertvector(mag, F) * splat<W>(5.9604644775390625e-8f);  // 2^-24
    U out = expo == 0x7c00u ? special : normal;
    out = expo == 0u ? (U)sub : out;
    return (F)(out | sign);
}

// Load W logits starting at element j of a row as float; lanes at or past `valid` are NaN
// (NaN fails every comparison and counts as non-finite, so padding changes nothing).
template <int W, int DT>
ICQS_INLINE typename V<W>::f load(const void* row, int64_t j, int64_t valid) {
    using F = typename V<W>::f;
    if (DT == kF32) {
        const float* p = static_cast<const float*>(row) + j;
        F z;
        if (valid >= W) {
            std::memcpy(&z, p, sizeof(z));
        } else {
            z = splat<W>(std::numeric_limits<float>::quiet_NaN());
            for (int64_t k = 0; k < valid; ++k) z[k] = p[k];
        }
        return z;
    } else {
        using H = typename V<W>::h;
        const uint16_t* p = static_cast<const uint16_t*>(row) + j;
        H raw;
        if (valid >= W) {
            std::memcpy(&raw, p, sizeof(raw));
        } else {
            // Quiet NaN padding: 0x7fc0 in bf16, 0x7e00 in fp16.
            raw = H{} + (uint16_t)(DT == kBF16 ? 0x7fc0u : 0x7e00u);
            for (int64_t k = 0; k < valid; ++k) raw[k] = p[k];
        }
        const typename V<W>::u h = __builtin_convertvector(raw, typename V<W>::u);
        if (DT == kBF16) return (F)(h << 16);
        return half_to_float<W>(h);
    }
}

template <int DT>
ICQS_INLINE float load1(const void* row, int64_t j) {
    if (DT == kF32) return static_cast<const float*>(row)[j];
    const uint32_t h = static_cast<const uint16_t*>(row)[j];
    if (DT == kBF16) {
        const uint32_t b = h << 16;
        float f;
        std::memcpy(&f, &b, sizeof(f));
        return f;
    }
    return half_bits_to_float(h);  // same steps as half_to_float, one value
}

template <int W>
struct Consts {
    typename V<W>::f gthr, eqval, cz, inv_t, a;  // a: tanh scale (SC only)
};

template <int W>
struct Pass1 {
    typename V<W>::f bmax;      // max of finite z
    typename V<W>::i gtv, eqv;  // z > z_t, z == z_t (negated counts: masks are -1)
    typename V<W>::i nv;        // finite count (negated)
    typename V<W>::dh u1v, u2v; // sum u, sum u^2 with u = (z - cz) / T over finite entries
};

// Pass 1 over one block of bl elements: read (and convert) it once, store the finite values
// (-inf elsewhere) in buf, and accumulate max, counts and u sums.
template <int W, int DT, bool SC, bool EQ>
ICQS_INLINE void pass1(const void* row, int64_t b0, int64_t bl, const Consts<W>& c, float* buf,
                       Pass1<W>& a) {
    using F = typename V<W>::f;
    using I = typename V<W>::i;
    using FH = typename V<W>::fh;
    using DH = typename V<W>::dh;
    const F vninf = splat<W>(-std::numeric_limits<float>::infinity());
    const int64_t nvec = (bl + W - 1) / W;
    for (int64_t k = 0; k < nvec; ++k) {
        F z = load<W, DT>(row, b0 + k * W, bl - k * W);
        a.gtv -= z > c.gthr;
        if (EQ) a.eqv -= z == c.eqval;
        if (SC) z = tanh_scaled<W>(z, c.a);
        const I fin = ((I)z & 0x7f800000) != 0x7f800000;
        a.nv -= fin;
        const F zf = fin ? z : vninf;
        a.bmax = vmax<W>(a.bmax, zf);
        const F u = fin ? (z - c.cz) * c.inv_t : F{};
        // u sums in double: x - K can be large next to the spread of x (cancellation).
        FH lo, hi;
        std::memcpy(&lo, &u, sizeof(lo));
        std::memcpy(&hi, reinterpret_cast<const char*>(&u) + sizeof(lo), sizeof(hi));
        const DH ulo = __builtin_convertvector(lo, DH);
        const DH uhi = __builtin_convertvector(hi, DH);
        a.u1v += ulo + uhi;
        a.u2v += ulo * ulo + uhi * uhi;
        std::memcpy(buf + k * W, &zf, sizeof(zf));
    }
}

struct RowIn {
    const void* row;
    int64_t v;
    int64_t t;       // target column in this row (may lie outside [0, v))
    double z_t;      // target logit
    double shift;    // K, in x = z / T units
    double temp;
    float tanh_scale;  // a of the soft-cap epilogue (used only by the SC kernels)
};

// The mode-independent row reduction: used for whole rows (token_stats) and for vocabulary
// blocks (reduce_block) alike, since both are "a row of logits plus a target index".
template <int W, int DT, bool SC>
ICQS_INLINE void reduce_row_impl(const RowIn& in, double* state, int64_t* counts) {
    using F = typename V<W>::f;
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
    const double cz_d = in.shift * in.temp;
    const float cz = std::isfinite(cz_d) && std::fabs(cz_d) < 3.0e38 ? static_cast<float>(cz_d)
                                                                      : 0.0f;
    const double delta = static_cast<double>(cz) / in.temp - in.shift;
    const int64_t t_lim = in.t < 0 ? 0 : (in.t > in.v ? in.v : in.t);

    const Consts<W> c{splat<W>(gthr), splat<W>(eqval), splat<W>(cz), splat<W>(inv_t),
                      splat<W>(in.tanh_scale)};

    double s0 = 0, s1 = 0, s2 = 0, su = 0, suu = 0;
    int64_t n_fin = 0, greater = 0, eq_before = 0;
    float zmax = -inf;  // running max of finite z (T > 0, so also of x)
    alignas(64) float buf[kBlock];

    for (int64_t b0 = 0; b0 < in.v; b0 += kBlock) {
        const int64_t bl = in.v - b0 < kBlock ? in.v - b0 : kBlock;
        const int64_t nvec = (bl + W - 1) / W;
        Pass1<W> acc{splat<W>(-inf), {}, {}, {}, {}, {}};
        // Equal-to-target entries count only before the target: whole blocks before it are
        // counted in the vector loop, the one block holding it by a scalar loop (an index mask
        // in the vector loop makes GCC scalarise it).
        if (b0 + bl <= t_lim) {
            pass1<W, DT, SC, true>(in.row, b0, bl, c, buf, acc);
        } else {
            pass1<W, DT, SC, false>(in.row, b0, bl, c, buf, acc);
            if (!SC && std::isfinite(eqval)) {
                // buf holds the block's finite values (-inf elsewhere): same answer, in L1
                // (not with the soft cap: buf holds the capped values, the ranks the uncapped).
                int64_t cnt = 0;
                for (int64_t j = 0; j < t_lim - b0; ++j) cnt += buf[j] == eqval;
                eq_before += cnt;
            } else {
                for (int64_t j = b0; j < t_lim; ++j) eq_before += load1<DT>(in.row, j) == eqval;
            }
        }
        float bm = -inf;
        for (int k = 0; k < W; ++k) {
            bm = acc.bmax[k] > bm ? acc.bmax[k] : bm;
            greater += acc.gtv[k];
            eq_before += acc.eqv[k];
            n_fin += acc.nv[k];
        }
        for (int k = 0; k < W / 2; ++k) {
            su += acc.u1v[k];
            suu += acc.u2v[k];
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
        const F vm = splat<W>(zmax), lo = splat<W>(-100.0f);
        F a0 = {}, a1 = {}, a2 = {};
        for (int64_t k = 0; k < nvec; ++k) {
            F zb;
            std::memcpy(&zb, buf + k * W, sizeof(zb));
            // -inf (non-finite or padding) becomes -100: e = 0 and e * d = 0, never NaN.
            const F d = vmax<W>((zb - vm) * c.inv_t, lo);
            const F e = exp_neg<W>(d);
            const F ed = e * d;
            a0 += e;
            a1 += ed;
            a2 += ed * d;
        }
        double b_0 = 0, b_1 = 0, b_2 = 0;
        for (int k = 0; k < W; ++k) {
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

typedef void (*RowFn)(const RowIn&, double*, int64_t*);

// One instantiation per (ISA, dtype, soft-cap); the helpers are always-inlined into these, so
// each is compiled entirely for its target. TanhFn: the epilogue alone over fp32 values, for the
// caller's target logits (the same code as the blocks', so saturated ties compare equal).
typedef void (*TanhFn)(const float*, float*, int64_t, float);

template <int W>
ICQS_INLINE void tanh_impl(const float* in, float* out, int64_t n, float a) {
    using F = typename V<W>::f;
    for (int64_t j = 0; j < n; j += W) {
        const int64_t m = n - j < W ? n - j : W;
        F z = splat<W>(0.0f);
        for (int64_t k = 0; k < m; ++k) z[k] = in[j + k];
        const F w = tanh_scaled<W>(z, splat<W>(a));
        for (int64_t k = 0; k < m; ++k) out[j + k] = w[k];
    }
}

#define ICQS_ROW_FNS(NAME, TARGET, W)                                                        \
    TARGET void NAME##_f32(const RowIn& in, double* s, int64_t* c) {                         \
        reduce_row_impl<W, kF32, false>(in, s, c);                                           \
    }                                                                                        \
    TARGET void NAME##_f16(const RowIn& in, double* s, int64_t* c) {                         \
        reduce_row_impl<W, kF16, false>(in, s, c);                                           \
    }                                                                                        \
    TARGET void NAME##_bf16(const RowIn& in, double* s, int64_t* c) {                        \
        reduce_row_impl<W, kBF16, false>(in, s, c);                                          \
    }                                                                                        \
    TARGET void NAME##_f32_sc(const RowIn& in, double* s, int64_t* c) {                      \
        reduce_row_impl<W, kF32, true>(in, s, c);                                            \
    }                                                                                        \
    TARGET void NAME##_f16_sc(const RowIn& in, double* s, int64_t* c) {                      \
        reduce_row_impl<W, kF16, true>(in, s, c);                                            \
    }                                                                                        \
    TARGET void NAME##_bf16_sc(const RowIn& in, double* s, int64_t* c) {                     \
        reduce_row_impl<W, kBF16, true>(in, s, c);                                           \
    }                                                                                        \
    TARGET void NAME##_tanh(const float* in, float* out, int64_t n, float a) {               \
        tanh_impl<W>(in, out, n, a);                                                         \
    }

ICQS_ROW_FNS(row_v2, , 4)
#if defined(__x86_64__) && !defined(ICQS_FAST_GENERIC_ONLY)
ICQS_ROW_FNS(row_v4, __attribute__((target("arch=x86-64-v4"))), 16)
ICQS_ROW_FNS(row_v3, __attribute__((target("arch=x86-64-v3"))), 8)

const RowFn kRowFns[3][2][3] = {
    {{row_v2_f32, row_v2_f16, row_v2_bf16}, {row_v2_f32_sc, row_v2_f16_sc, row_v2_bf16_sc}},
    {{row_v3_f32, row_v3_f16, row_v3_bf16}, {row_v3_f32_sc, row_v3_f16_sc, row_v3_bf16_sc}},
    {{row_v4_f32, row_v4_f16, row_v4_bf16}, {row_v4_f32_sc, row_v4_f16_sc, row_v4_bf16_sc}},
};
const TanhFn kTanhFns[3] = {row_v2_tanh, row_v3_tanh, row_v4_tanh};

int best_isa() { return cpu_isa_level(); }
#else
// Other architectures (e.g. aarch64 NEON): the portable 4-lane kernel only
// (-DICQS_FAST_GENERIC_ONLY builds this variant on x86-64, to test it).
const RowFn kRowFns[1][2][3] = {
    {{row_v2_f32, row_v2_f16, row_v2_bf16}, {row_v2_f32_sc, row_v2_f16_sc, row_v2_bf16_sc}}};
const TanhFn kTanhFns[1] = {row_v2_tanh};

int best_isa() { return kIsaV2; }
#endif


void reduce_rows(uintptr_t z_ptr, int64_t row_stride, int64_t n, int64_t v, int dtype,
                 uintptr_t t_ptr, uintptr_t zt_ptr, uintptr_t shift_ptr, double temperature,
                 uintptr_t state_ptr, uintptr_t counts_ptr, int nthreads, int isa,
                 double tanh_scale) {
    if (n < 0 || v < 0) throw std::invalid_argument("reduce_rows: n and v must be >= 0");
    if (v >= (int64_t(1) << 31) - kBlock)
        throw std::invalid_argument("reduce_rows: vocabulary size must be < 2^31");
    if (!(temperature > 0) || !std::isfinite(temperature))
        throw std::invalid_argument("reduce_rows: temperature must be finite and > 0");
    if (dtype != kF32 && dtype != kF16 && dtype != kBF16)
        throw std::invalid_argument("reduce_rows: dtype code must be 0 (fp32), 1 (fp16), 2 (bf16)");
    if (!std::isfinite(tanh_scale))
        throw std::invalid_argument("reduce_rows: tanh_scale must be finite (0 = no soft cap)");
    isa = pick_isa(isa);
    const RowFn fn = kRowFns[isa][tanh_scale != 0.0][dtype];
    const float a = static_cast<float>(tanh_scale);
    const size_t esize = dtype == kF32 ? 4 : 2;
    const char* z = reinterpret_cast<const char*>(z_ptr);
    const int64_t* t = reinterpret_cast<const int64_t*>(t_ptr);
    const double* zt = reinterpret_cast<const double*>(zt_ptr);
    const double* shift = reinterpret_cast<const double*>(shift_ptr);
    double* state = reinterpret_cast<double*>(state_ptr);
    int64_t* counts = reinterpret_cast<int64_t*>(counts_ptr);
    if (nthreads < 1) nthreads = 1;

    py::gil_scoped_release nogil;
// Dynamic chunks of rows: on a shared machine a descheduled thread does not hold up the rest.
#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads) if (n > 1 && nthreads > 1)
    for (int64_t i = 0; i < n; ++i) {
        const RowIn in{z + static_cast<size_t>(i) * static_cast<size_t>(row_stride) * esize, v,
                       t[i], zt[i], shift[i], temperature, a};
        fn(in, state + 7 * i, counts + 2 * i);
    }
}

void tanh_rows(uintptr_t in_ptr, uintptr_t out_ptr, int64_t n, double tanh_scale, int isa) {
    if (n < 0) throw std::invalid_argument("tanh_rows: n must be >= 0");
    if (!std::isfinite(tanh_scale) || tanh_scale == 0.0)
        throw std::invalid_argument("tanh_rows: tanh_scale must be finite and != 0");
    const TanhFn fn = kTanhFns[pick_isa(isa)];
    py::gil_scoped_release nogil;
    fn(reinterpret_cast<const float*>(in_ptr), reinterpret_cast<float*>(out_ptr), n,
       static_cast<float>(tanh_scale));
}

#if defined(__x86_64__) && !defined(ICQS_FAST_GENERIC_ONLY)
const char* const kIsaNames[3] = {"x86-64-v2 (SSE4.2, 4 lanes)", "x86-64-v3 (AVX2+FMA, 8 lanes)",
                                  "x86-64-v4 (AVX-512, 16 lanes)"};
#else
const char* const kIsaNames[3] = {"generic (4 lanes)", "", ""};
#endif

int max_threads() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

}  // namespace

// Defined in attention.cpp (the cpp backend of ops.attention_lse).
void register_attention(py::module_& m);
// Defined in linear.cpp (the cpp backend of ops.linear).
void register_linear(py::module_& m);
// Defined in rotary.cpp (the cpp backend of ops.rotary).
void register_rotary(py::module_& m);
// Defined in concat_slots.cpp (the cpp backend of ops.concat_slots).
void register_concat_slots(py::module_& m);
// Defined in rowwise.cpp (the cpp backends of ops.rms_norm and ops.silu_mul).
void register_rowwise(py::module_& m);

PYBIND11_MODULE(_C, m) {
    m.doc() = "icqs_fast C++/OpenMP CPU kernels (raw pointers in, no torch headers)";
    register_attention(m);
    register_linear(m);
    register_rotary(m);
    register_concat_slots(m);
    register_rowwise(m);
    m.def("reduce_rows", &reduce_rows, py::arg("z_ptr"), py::arg("row_stride"), py::arg("n"),
          py::arg("v"), py::arg("dtype"), py::arg("t_ptr"), py::arg("zt_ptr"),
          py::arg("shift_ptr"), py::arg("temperature"), py::arg("state_ptr"),
          py::arg("counts_ptr"), py::arg("nthreads"), py::arg("isa") = -1,
          py::arg("tanh_scale") = 0.0,
          "Per-row softmax state [n,7] float64 and counts [n,2] int64 of a [n,v] logits array "
          "(row_stride in elements, unit column stride; dtype 0=fp32, 1=fp16, 2=bf16; t int64, "
          "zt/shift float64 per row). Writes into the given output buffers. isa: -1 = best for "
          "this CPU, else 0 (x86-64-v2), 1 (x86-64-v3), 2 (x86-64-v4) - for tests. tanh_scale a != 0: "
          "the soft-cap epilogue: counts compare the logits as given (zt: the target's), every "
          "other sum uses tanh(a z) (shift: in those units).");
    m.def("tanh_rows", &tanh_rows, py::arg("in_ptr"), py::arg("out_ptr"), py::arg("n"),
          py::arg("tanh_scale"), py::arg("isa") = -1,
          "out[i] = tanh(a in[i]) over n fp32 values with reduce_rows' epilogue code (same "
          "ISA choice), for the target logits.");
    m.def("best_isa", &best_isa, "the ISA level reduce_rows uses by default (0, 1 or 2)");
    m.def("isa_name", [](int isa) -> std::string {
        if (isa < 0 || isa > best_isa())
            throw std::invalid_argument("isa must be between 0 and best_isa()");
        return kIsaNames[isa];
    });
    m.def("simd_level", []() -> std::string { return kIsaNames[best_isa()]; },
          "ISA level (and vector width) of the kernel this CPU runs");
    m.def("max_threads", &max_threads, "OpenMP's default thread count (1 without OpenMP)");
#ifdef _OPENMP
    m.attr("openmp") = true;
#else
    m.attr("openmp") = false;
#endif
}

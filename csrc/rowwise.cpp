// Row-wise fp32 passes of the bf16-products forward, for the cpp backend of ops.rms_norm and
// ops.silu_mul (icqs_fast._C.rms_norm / _C.silu_mul):
//
//   rms_norm:  out[r, i] = (x[r, i] * s_r) * w[i],  s_r = 1 / sqrt(sum_i x[r, i]^2 / D + eps)
//   silu_mul:  out[r, i] = silu(g[r, i]) * u[r, i],  silu(g) = g / (1 + e^-g)
//
// torch runs the norm as five passes over the activations (square, sum, rsqrt, two products)
// and the gated MLP's SiLU and product as two; these are one read of each input and one write.
// Each row is computed alone, in one fixed order that depends only on D: the sum of squares in
// 16 interleaved partial sums (lane i % 16), then added pairwise (8, 4, 2, 1). So a row's bits
// depend on nothing else in the call, and not on the ISA either (no fused multiply-add in the
// norm: fp-contract is off). SiLU takes the kernels' shared e^d (~1 ulp, simd_math.h), so its
// last bit may differ from torch's (Sleef) and between ISA levels: the forward that uses it
// rounds its products to bf16 anyway (icqs_fast.exact_forwards). The gated linear product's
// epilogue (linear.cpp) calls these same row functions (silu_row_at), so it has their bits.
//
// No torch headers: Python passes raw pointers and row strides (unit last-dim strides).

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstring>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "simd_math.h"

namespace py = pybind11;

using SiluRowFn = void (*)(const float*, const float*, float*, int64_t);
// Defined in linear.cpp: a row rounded to bf16 as ops.linear rounds its x.
void bf16_round_row(const float* src, int64_t n, uint16_t* dst, int isa);

namespace {

constexpr int kLanes = 16;  // the norm's partial sums, whatever the vector width

// Rows per OpenMP task: the two vCPUs of a shared core run at different speeds, so the rows
// are handed out in small dynamic chunks rather than split in halves (docs/DECISIONS.md).
constexpr int64_t kRowChunk = 16;

#define ICQS_ROWWISE_NORM(NAME, TARGET)                                                      \
    TARGET __attribute__((optimize("fp-contract=off"))) void NAME(                            \
        const float* x, const float* w, float* out, int64_t D, float eps) {                   \
        float acc[kLanes] = {};                                                               \
        const int64_t full = D - D % kLanes;                                                  \
        for (int64_t i = 0; i < full; i += kLanes)                                            \
            for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j] * x[i + j];                   \
        for (int64_t i = full; i < D; ++i) acc[i - full] += x[i] * x[i];                      \
        for (int s = kLanes / 2; s > 0; s /= 2)                                               \
            for (int j = 0; j < s; ++j) acc[j] += acc[j + s];                                 \
        const float scale = 1.0f / std::sqrt(acc[0] / static_cast<float>(D) + eps);           \
        for (int64_t i = 0; i < D; ++i) out[i] = (x[i] * scale) * w[i];                       \
    }

// out[i] = silu(g[i]) * u[i] over n fp32 values, silu(g) = g / (1 + e^-g), taken as
// g e^g / (1 + e^g) for g < 0 so that e^-|g| (exp_neg's domain) never overflows; gates below
// -87 give -0. out may be g or u.
template <int W>
ICQS_SIMD_INLINE void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
    using F = typename V<W>::f;
    for (int64_t j = 0; j < n; j += W) {
        const int64_t m = n - j < W ? n - j : W;
        F a = splat<W>(0.0f), b = splat<W>(0.0f);
        if (m == W) {
            std::memcpy(&a, g + j, sizeof(F));
            std::memcpy(&b, u + j, sizeof(F));
        } else {
            for (int64_t k = 0; k < m; ++k) a[k] = g[j + k], b[k] = u[j + k];
        }
        const F neg = a < splat<W>(0.0f) ? a : -a;
        const F e = exp_neg<W>(neg);
        const F num = a < splat<W>(0.0f) ? a * e : a;
        const F r = num / (splat<W>(1.0f) + e) * b;
        if (m == W) {
            std::memcpy(out + j, &r, sizeof(F));
        } else {
            for (int64_t k = 0; k < m; ++k) out[j + k] = r[k];
        }
    }
}

typedef void (*NormFn)(const float*, const float*, float*, int64_t, float);

ICQS_ROWWISE_NORM(norm_v2, )
void silu_v2(const float* g, const float* u, float* out, int64_t n) {
    silu_mul_row<4>(g, u, out, n);
}
#if defined(__x86_64__) && !defined(ICQS_FAST_GENERIC_ONLY)
ICQS_ROWWISE_NORM(norm_v3, __attribute__((target("arch=x86-64-v3"))))
ICQS_ROWWISE_NORM(norm_v4, __attribute__((target("arch=x86-64-v4"))))
__attribute__((target("arch=x86-64-v3"))) void silu_v3(const float* g, const float* u,
                                                       float* out, int64_t n) {
    silu_mul_row<8>(g, u, out, n);
}
__attribute__((target("arch=x86-64-v4"))) void silu_v4(const float* g, const float* u,
                                                       float* out, int64_t n) {
    silu_mul_row<16>(g, u, out, n);
}
const NormFn kNormFns[3] = {norm_v2, norm_v3, norm_v4};
const SiluRowFn kSiluRowFns[3] = {silu_v2, silu_v3, silu_v4};
#else
const NormFn kNormFns[1] = {norm_v2};
const SiluRowFn kSiluRowFns[1] = {silu_v2};
#endif

// The norm of each row of x, or with r (add_rms_norm) of sum = r + x: the decoder layer's
// residual add in fp32 (the bits of torch's add), written beside the norm, which reads the row
// while it is in L1 (one pass over the rows where the add and the norm took two).
// out_bf16: the normed rows rounded to bf16 (as the bf16-products linear that reads them
// would round them), half the bytes written and none of the product's conversion pass.
void norm_rows(uintptr_t x, int64_t x_stride, uintptr_t r, int64_t r_stride, uintptr_t w,
               uintptr_t sum, int64_t sum_stride, uintptr_t out, int64_t out_stride, int64_t R,
               int64_t D, double eps, int nthreads, int isa, bool out_bf16 = false) {
    const NormFn fn = kNormFns[pick_isa(isa)];
    const float* xp = reinterpret_cast<const float*>(x);
    const float* rp = reinterpret_cast<const float*>(r);
    const float* wp = reinterpret_cast<const float*>(w);
    float* sp = reinterpret_cast<float*>(sum);
    float* op = reinterpret_cast<float*>(out);
    const float e = static_cast<float>(eps);
    py::gil_scoped_release nogil;
#pragma omp parallel for schedule(dynamic, kRowChunk) num_threads(nthreads) if (R * D > (1 << 15) && nthreads > 1)
    for (int64_t i = 0; i < R; ++i) {
        const float* row = xp + i * x_stride;
        if (rp != nullptr) {
            const float* rr = rp + i * r_stride;
            float* sr = sp + i * sum_stride;
            for (int64_t j = 0; j < D; ++j) sr[j] = rr[j] + row[j];
            row = sr;
        }
        if (!out_bf16) {
            fn(row, wp, op + i * out_stride, D, e);
            continue;
        }
        static thread_local std::vector<float> normed;
        if (normed.size() < static_cast<size_t>(D)) normed.resize(D);
        fn(row, wp, normed.data(), D, e);
        bf16_round_row(normed.data(), D, reinterpret_cast<uint16_t*>(out) + i * out_stride, isa);
    }
}

void rms_norm(uintptr_t x, int64_t x_stride, uintptr_t w, uintptr_t out, int64_t out_stride,
              int64_t R, int64_t D, double eps, int nthreads, int isa, bool out_bf16) {
    if (R < 0 || D < 1 || x_stride < D || out_stride < D)
        throw std::invalid_argument("rms_norm: R >= 0, D >= 1 and row strides >= D");
    norm_rows(x, x_stride, 0, 0, w, 0, 0, out, out_stride, R, D, eps, nthreads, isa, out_bf16);
}

void add_rms_norm(uintptr_t x, int64_t x_stride, uintptr_t r, int64_t r_stride, uintptr_t w,
                  uintptr_t sum, int64_t sum_stride, uintptr_t out, int64_t out_stride,
                  int64_t R, int64_t D, double eps, int nthreads, int isa, bool out_bf16) {
    if (R < 0 || D < 1 || x_stride < D || r_stride < D || sum_stride < D || out_stride < D ||
        r == 0 || sum == 0)
        throw std::invalid_argument("add_rms_norm: R >= 0, D >= 1, row strides >= D, r and sum");
    norm_rows(x, x_stride, r, r_stride, w, sum, sum_stride, out, out_stride, R, D, eps, nthreads,
              isa, out_bf16);
}

void silu_mul(uintptr_t g, int64_t g_stride, uintptr_t u, int64_t u_stride, uintptr_t out,
              int64_t out_stride, int64_t R, int64_t N, int nthreads, int isa) {
    if (R < 0 || N < 0 || g_stride < N || u_stride < N || out_stride < N)
        throw std::invalid_argument("silu_mul: R, N >= 0 and row strides >= N");
    const SiluRowFn fn = kSiluRowFns[pick_isa(isa)];
    const float* gp = reinterpret_cast<const float*>(g);
    const float* up = reinterpret_cast<const float*>(u);
    float* op = reinterpret_cast<float*>(out);
    py::gil_scoped_release nogil;
#pragma omp parallel for schedule(dynamic, kRowChunk) num_threads(nthreads) if (R * N > (1 << 15) && nthreads > 1)
    for (int64_t r = 0; r < R; ++r) fn(gp + r * g_stride, up + r * u_stride, op + r * out_stride, N);
}

}  // namespace

SiluRowFn silu_row_at(int isa) { return kSiluRowFns[pick_isa(isa)]; }

void register_rowwise(py::module_& m) {
    m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("x_stride"), py::arg("w"), py::arg("out"),
          py::arg("out_stride"), py::arg("R"), py::arg("D"), py::arg("eps"), py::arg("nthreads"),
          py::arg("isa") = -1, py::arg("out_bf16") = false,
          "out [R,D] fp32 = (x * s) * w per row, s = 1/sqrt(mean(x^2) + eps), the sum in 16 "
          "interleaved lanes then pairwise (row strides in elements). isa: -1 best, 0/1/2. "
          "out_bf16: out rounded to bf16 as linear rounds a bf16-products x.");
    m.def("add_rms_norm", &add_rms_norm, py::arg("x"), py::arg("x_stride"), py::arg("r"),
          py::arg("r_stride"), py::arg("w"), py::arg("sum"), py::arg("sum_stride"),
          py::arg("out"), py::arg("out_stride"), py::arg("R"), py::arg("D"), py::arg("eps"),
          py::arg("nthreads"), py::arg("isa") = -1, py::arg("out_bf16") = false,
          "sum [R,D] = r + x, out [R,D] = rms_norm(sum) as rms_norm computes it (fp32 rows, row "
          "strides in elements). isa: -1 best, 0/1/2. out_bf16: out rounded to bf16 as "
          "linear rounds a bf16-products x.");
    m.def("silu_mul", &silu_mul, py::arg("g"), py::arg("g_stride"), py::arg("u"),
          py::arg("u_stride"), py::arg("out"), py::arg("out_stride"), py::arg("R"), py::arg("N"),
          py::arg("nthreads"), py::arg("isa") = -1,
          "out [R,N] fp32 = silu(g) * u (row strides in elements; out may be g). isa: -1 best, "
          "0/1/2.");
}

// Rotary position embedding for the cpp backend of ops.rotary (icqs_fast._C.rotary):
//
//   out[b, h, t, i] = x[b, h, t, i] c[b, t, i] + r[i] s[b, t, i],
//   r[i] = -x[i + D/2] for i < D/2, else x[i - D/2]   (transformers' rotate_half)
//
// in fp32, each product and the sum rounded once, in that order: the arithmetic of
// transformers' `q * cos + rotate_half(q) * sin`, so the same bits (a + (-b) is a - b exactly).
// One pass over x instead of that expression's five (two products, a negation, a
// concatenation, a sum), with no temporaries. fp-contract is off: a fused multiply-add would
// round once where transformers rounds twice.
//
// No torch headers: Python passes raw pointers and element strides (dims 0..2; unit last-dim
// strides); a stride of 0 broadcasts c / s over the batch.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "simd_math.h"

namespace py = pybind11;

using RotaryRowFn = void (*)(const float*, const float*, const float*, float*, int64_t);

namespace {

// One row of 2 * half values, compiled for each ISA level (W lanes, then a scalar tail): each
// pair (x[i], x[i + half]) is read before its two outputs are written, so out may be x itself;
// products and sums are rounded one by one (no contraction), so every vector width gives the
// same bits. Also the rotary epilogue of ops.linear's query / key products (linear.cpp,
// rotary_row_at), so the two have one arithmetic; there the rows are in cache and the vector
// width counts (the x86-64-v2 build's 4 lanes, through a copy of each head, took 1.6 % of an
// ICQS run).
#define ICQS_ROTARY_ROW_BODY(W)                                                        \
    typedef float F __attribute__((vector_size(4 * (W))));                            \
    int64_t i = 0;                                                                     \
    for (; i + (W) <= half; i += (W)) {                                                \
        F x0, x1, c0, c1, s0, s1;                                                      \
        std::memcpy(&x0, xr + i, sizeof(F));                                           \
        std::memcpy(&x1, xr + i + half, sizeof(F));                                    \
        std::memcpy(&c0, cr + i, sizeof(F));                                           \
        std::memcpy(&c1, cr + i + half, sizeof(F));                                    \
        std::memcpy(&s0, sr + i, sizeof(F));                                           \
        std::memcpy(&s1, sr + i + half, sizeof(F));                                    \
        const F lo = x0 * c0 - x1 * s0, hi = x1 * c1 + x0 * s1;                        \
        std::memcpy(o + i, &lo, sizeof(F));                                            \
        std::memcpy(o + i + half, &hi, sizeof(F));                                     \
    }                                                                                  \
    for (; i < half; ++i) {                                                            \
        const float x0 = xr[i], x1 = xr[i + half];                                     \
        const float lo = x0 * cr[i] - x1 * sr[i];                                      \
        const float hi = x1 * cr[i + half] + x0 * sr[i + half];                        \
        o[i] = lo;                                                                     \
        o[i + half] = hi;                                                              \
    }

__attribute__((optimize("fp-contract=off"))) void rotary_row_v2(
    const float* xr, const float* cr, const float* sr, float* o, int64_t half) {
    ICQS_ROTARY_ROW_BODY(4)
}

#if defined(__x86_64__) && !defined(ICQS_FAST_GENERIC_ONLY)
__attribute__((optimize("fp-contract=off"), target("arch=x86-64-v3"))) void rotary_row_v3(
    const float* xr, const float* cr, const float* sr, float* o, int64_t half) {
    ICQS_ROTARY_ROW_BODY(8)
}
__attribute__((optimize("fp-contract=off"), target("arch=x86-64-v4"))) void rotary_row_v4(
    const float* xr, const float* cr, const float* sr, float* o, int64_t half) {
    ICQS_ROTARY_ROW_BODY(16)
}
const RotaryRowFn kRotaryRowFns[3] = {rotary_row_v2, rotary_row_v3, rotary_row_v4};
#else
const RotaryRowFn kRotaryRowFns[1] = {rotary_row_v2};
#endif
#undef ICQS_ROTARY_ROW_BODY

}  // namespace

RotaryRowFn rotary_row_at(int isa) { return kRotaryRowFns[pick_isa(isa)]; }

namespace {

void rotary_rows(const float* x, const int64_t* xs, const float* c, const float* s,
                 const int64_t* cs, float* out, const int64_t* os, int64_t B, int64_t H,
                 int64_t T, int64_t D, int nthreads, RotaryRowFn rotary_row) {
    const int64_t rows = B * H * T;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * D > (1 << 16) && nthreads > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = r / (H * T), h = (r / T) % H, t = r % T;
        rotary_row(x + b * xs[0] + h * xs[1] + t * xs[2], c + b * cs[0] + t * cs[1],
                   s + b * cs[0] + t * cs[1], out + b * os[0] + h * os[1] + t * os[2], D / 2);
    }
}

void rotary(uintptr_t x, py::tuple x_strides, uintptr_t cos, uintptr_t sin, py::tuple cs_strides,
            uintptr_t out, py::tuple out_strides, int64_t B, int64_t H, int64_t T, int64_t D,
            int nthreads, int isa) {
    if (B < 0 || H < 0 || T < 0 || D < 2 || D % 2)
        throw std::invalid_argument("rotary: sizes B, H, T >= 0 and an even D >= 2");
    if (x_strides.size() != 3 || cs_strides.size() != 2 || out_strides.size() != 3)
        throw std::invalid_argument("rotary: strides of x / out dims 0..2, of cos / sin dims 0..1");
    int64_t xs[3], cs[2], os[3];
    for (int i = 0; i < 3; ++i) {
        xs[i] = x_strides[i].cast<int64_t>();
        os[i] = out_strides[i].cast<int64_t>();
    }
    for (int i = 0; i < 2; ++i) cs[i] = cs_strides[i].cast<int64_t>();
    const RotaryRowFn row = rotary_row_at(isa);  // an ISA above the CPU's: invalid_argument
    py::gil_scoped_release nogil;
    rotary_rows(reinterpret_cast<const float*>(x), xs, reinterpret_cast<const float*>(cos),
                reinterpret_cast<const float*>(sin), cs, reinterpret_cast<float*>(out), os, B, H,
                T, D, nthreads < 1 ? 1 : nthreads, row);
}

}  // namespace

void register_rotary(py::module_& m) {
    m.def("rotary", &rotary, py::arg("x"), py::arg("x_strides"), py::arg("cos"), py::arg("sin"),
          py::arg("cs_strides"), py::arg("out"), py::arg("out_strides"), py::arg("B"),
          py::arg("H"), py::arg("T"), py::arg("D"), py::arg("nthreads"), py::arg("isa") = -1,
          "out [B,H,T,D] fp32 = x * cos + rotate_half(x) * sin (cos / sin [B,T,D], the same "
          "strides), each product and the sum rounded once: transformers' bits (the same at "
          "every ISA level; isa: -1 best, 0/1/2).");
}

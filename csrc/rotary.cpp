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
#include <stdexcept>

namespace py = pybind11;

// One row of 2 * half values (out must not alias x). Also the rotary epilogue of ops.linear's
// query / key products (linear.cpp), so the two have one arithmetic.
__attribute__((optimize("fp-contract=off"))) void rotary_row(const float* xr, const float* cr,
                                                            const float* sr, float* o,
                                                            int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float a = xr[i] * cr[i], m = xr[i + half] * sr[i];
        o[i] = a - m;
    }
    for (int64_t i = half; i < 2 * half; ++i) {
        const float a = xr[i] * cr[i], m = xr[i - half] * sr[i];
        o[i] = a + m;
    }
}

namespace {

void rotary_rows(const float* x, const int64_t* xs, const float* c, const float* s,
                 const int64_t* cs, float* out, const int64_t* os, int64_t B, int64_t H,
                 int64_t T, int64_t D, int nthreads) {
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
            int nthreads) {
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
    py::gil_scoped_release nogil;
    rotary_rows(reinterpret_cast<const float*>(x), xs, reinterpret_cast<const float*>(cos),
                reinterpret_cast<const float*>(sin), cs, reinterpret_cast<float*>(out), os, B, H,
                T, D, nthreads < 1 ? 1 : nthreads);
}

}  // namespace

void register_rotary(py::module_& m) {
    m.def("rotary", &rotary, py::arg("x"), py::arg("x_strides"), py::arg("cos"), py::arg("sin"),
          py::arg("cs_strides"), py::arg("out"), py::arg("out_strides"), py::arg("B"),
          py::arg("H"), py::arg("T"), py::arg("D"), py::arg("nthreads"),
          "out [B,H,T,D] fp32 = x * cos + rotate_half(x) * sin (cos / sin [B,T,D], the same "
          "strides), each product and the sum rounded once: transformers' bits");
}

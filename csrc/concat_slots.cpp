// Per-row slot runs of several sources, back to back, for the cpp backend of ops.concat_slots
// (icqs_fast._C.concat_slots):
//
//   out[r, h, o_pr + j, :] = src_p[rows_p[r], h, starts_p[r] + j, :],  j < counts_p[r],
//   o_pr = counts_0[r] + ... + counts_{p-1}[r],  slots past the last part's run: 0.
//
// The cascade builds each row's keys and values so (its entry's last partial key block, its
// shared query tokens, its own), once per layer; in torch that took an advanced index, a
// concatenation and a gather of an expanded index: about 1 ms a layer on the 2-core CPU for
// 20 rows. Here it is one memcpy per (row, head, part) where a source's slots are contiguous.
// A copy: the same bits in any dtype (elements are moved as bytes).
//
// No torch headers: Python passes raw pointers and element strides (dims 0..2; unit last-dim
// strides); out is contiguous [R, H, W, D].

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

void concat_slots(uintptr_t out, int64_t R, int64_t H, int64_t W, int64_t D, int64_t esize,
                  const std::vector<uintptr_t>& src, const std::vector<int64_t>& strides,
                  const std::vector<int64_t>& n_rows, const std::vector<int64_t>& n_slots,
                  const std::vector<uintptr_t>& rows, const std::vector<uintptr_t>& starts,
                  const std::vector<uintptr_t>& counts, int nthreads) {
    const size_t P = src.size();
    if (R < 0 || H < 0 || W < 0 || D < 0 || (esize != 2 && esize != 4 && esize != 8))
        throw std::invalid_argument("concat_slots: sizes R, H, W, D >= 0, element size 2/4/8");
    if (strides.size() != 3 * P || n_rows.size() != P || n_slots.size() != P ||
        rows.size() != P || starts.size() != P || counts.size() != P)
        throw std::invalid_argument("concat_slots: one pointer, 3 strides, sizes and 3 index "
                                    "arrays per part");
    // Checked before any copy: a bad index names its part and row, and nothing is read.
    for (int64_t r = 0; r < R; ++r) {
        int64_t total = 0;
        for (size_t p = 0; p < P; ++p) {
            const int64_t row = reinterpret_cast<const int64_t*>(rows[p])[r];
            const int64_t st = reinterpret_cast<const int64_t*>(starts[p])[r];
            const int64_t n = reinterpret_cast<const int64_t*>(counts[p])[r];
            if (row < 0 || row >= n_rows[p] || st < 0 || n < 0 || st + n > n_slots[p])
                throw std::out_of_range(
                    "concat_slots: part " + std::to_string(p) + ", row " + std::to_string(r) +
                    ": source row " + std::to_string(row) + " of " + std::to_string(n_rows[p]) +
                    ", slots [" + std::to_string(st) + ", " + std::to_string(st + n) + ") of " +
                    std::to_string(n_slots[p]));
            total += n;
        }
        if (total > W)
            throw std::out_of_range("concat_slots: row " + std::to_string(r) + " holds " +
                                    std::to_string(total) + " slots, more than the width " +
                                    std::to_string(W));
    }
    py::gil_scoped_release nogil;
    const int64_t line = D * esize;  // bytes of one slot
    char* o = reinterpret_cast<char*>(out);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (R * H * W * D > (1 << 16) && nthreads > 1)
    for (int64_t rh = 0; rh < R * H; ++rh) {
        const int64_t r = rh / H, h = rh % H;
        char* dst = o + rh * W * line;
        int64_t off = 0;
        for (size_t p = 0; p < P; ++p) {
            const int64_t row = reinterpret_cast<const int64_t*>(rows[p])[r];
            const int64_t st = reinterpret_cast<const int64_t*>(starts[p])[r];
            const int64_t n = reinterpret_cast<const int64_t*>(counts[p])[r];
            const int64_t* s = strides.data() + 3 * p;
            const char* base = reinterpret_cast<const char*>(src[p]) +
                               (row * s[0] + h * s[1] + st * s[2]) * esize;
            if (s[2] == D) {
                std::memcpy(dst + off * line, base, static_cast<size_t>(n * line));
            } else {
                for (int64_t j = 0; j < n; ++j)
                    std::memcpy(dst + (off + j) * line, base + j * s[2] * esize,
                                static_cast<size_t>(line));
            }
            off += n;
        }
        std::memset(dst + off * line, 0, static_cast<size_t>((W - off) * line));
    }
}

}  // namespace

void register_concat_slots(py::module_& m) {
    m.def("concat_slots", &concat_slots, py::arg("out"), py::arg("R"), py::arg("H"),
          py::arg("W"), py::arg("D"), py::arg("esize"), py::arg("src"), py::arg("strides"),
          py::arg("n_rows"), py::arg("n_slots"), py::arg("rows"), py::arg("starts"),
          py::arg("counts"), py::arg("nthreads"),
          "out [R,H,W,D] (contiguous) = per row, part p's slots src_p[rows_p[r], :, starts_p[r] "
          ": starts_p[r] + counts_p[r]] after the earlier parts', then zeros; strides: 3 element "
          "strides (dims 0..2) per part; rows / starts / counts: int64 [R] pointers per part. "
          "Raises IndexError (nothing copied) for an index out of range or a row over W.");
}

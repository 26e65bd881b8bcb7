// Vector math shared by the CPU kernels (token_stats.cpp, attention.cpp): GCC vector-extension
// types of W float lanes, e^d for d <= 0, tanh for the soft caps, the scalar IEEE half ->
// float conversion, and the ISA level the CPU runs.
//
// Everything is always inlined: each kernel instantiates these inside its per-ISA functions
// (target attributes x86-64-v2/v3/v4), so the same code compiles for every vector width, and
// no vector crosses a call boundary. The anonymous namespace keeps each translation unit's
// copies its own (they are compiled for that file's targets).

#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) && !defined(ICQS_FAST_GENERIC_ONLY)
#include <immintrin.h>
#endif

namespace {

#define ICQS_SIMD_INLINE inline __attribute__((always_inline))

// Vector types of W lanes (W floats = 4W bytes).
template <int W>
struct V {
    typedef float f __attribute__((vector_size(4 * W)));
    typedef int32_t i __attribute__((vector_size(4 * W)));
    typedef uint32_t u __attribute__((vector_size(4 * W)));
    typedef uint16_t h __attribute__((vector_size(2 * W)));
    typedef float fh __attribute__((vector_size(2 * W)));   // half a vector of floats
    typedef double dh __attribute__((vector_size(4 * W)));  // ... as doubles
};

template <int W>
ICQS_SIMD_INLINE typename V<W>::f splat(float a) {
    return typename V<W>::f{} + a;
}

// e^d for d <= 0 (Cephes expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp);
// d < -87 (and -inf) gives exactly 0. The input is clamped at -87 first so that -inf never
// enters the range reduction (the clamped lanes are replaced by 0 at the end anyway).
template <int W>
ICQS_SIMD_INLINE typename V<W>::f exp_neg(typename V<W>::f d) {
    using F = typename V<W>::f;
    using I = typename V<W>::i;
    const F magic = splat<W>(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    const F dd = d < splat<W>(-87.0f) ? splat<W>(-87.0f) : d;
    const F t = dd * splat<W>(1.44269504088896341f) + magic;
    const F nf = t - magic;
    const I n = (I)t - (I)magic;
    F r = dd - nf * splat<W>(0.693359375f);
    r = r - nf * splat<W>(-2.12194440e-4f);
    F p = splat<W>(1.9875691500e-4f);
    p = p * r + splat<W>(1.3981999507e-3f);
    p = p * r + splat<W>(8.3334519073e-3f);
    p = p * r + splat<W>(4.1665795894e-2f);
    p = p * r + splat<W>(1.6666665459e-1f);
    p = p * r + splat<W>(5.0000001201e-1f);
    p = p * (r * r) + r + splat<W>(1.0f);
    const I n_safe = n < -126 ? I{} - 126 : n;
    const F e = p * (F)((n_safe + 127) << 23);
    return d < splat<W>(-87.0f) ? F{} : e;
}

// 2^x for x <= 0, ~1e-7 relative (the degree-6 relative-error fit of 2^f on [-1/2, 1/2]):
// x = n + f with n = round(x); 2^n is built in the exponent bits. x < -126.5 (and -inf) gives
// exactly 0: clamped at -127, whose exponent field is 0. Fewer operations than exp_neg (no
// ln 2 range reduction, no denormal guard): for softmax on scores already in log2 units.
template <int W>
ICQS_SIMD_INLINE typename V<W>::f exp2_neg(typename V<W>::f x) {
    using F = typename V<W>::f;
    using I = typename V<W>::i;
    // 1.5 * 2^23 + 127: adding it rounds to an integer n, and the low bits of the sum hold n + 127.
    const F magic = splat<W>(12583039.0f);
    const F xc = x < splat<W>(-127.0f) ? splat<W>(-127.0f) : x;
    const F t = xc + magic;
    const F f = xc - (t - magic);
    F p = splat<W>(1.5394066576845944e-4f);
    p = p * f + splat<W>(1.3408148661255836e-3f);
    p = p * f + splat<W>(9.618324227631092e-3f);
    p = p * f + splat<W>(5.550302192568779e-2f);
    p = p * f + splat<W>(2.4022647738456726e-1f);
    p = p * f + splat<W>(6.931472420692444e-1f);
    p = p * f + splat<W>(1.0f);
    return p * (F)((I)t << 23);
}

// tanh(a z) to ~2 ulp: Cephes' odd polynomial for |u| < 0.625, else (1 - e) / (1 + e) with
// e = e^{-2|u|} (exp_neg's domain), sign restored. +-inf gives +-1; NaN stays NaN. The soft
// caps c tanh(s / c) (attention scores, the head's logits) are this with a = 1 / c, times c;
// kernels/linear_token_stats.py uses the same formula.
template <int W>
ICQS_SIMD_INLINE typename V<W>::f tanh_scaled(typename V<W>::f z, typename V<W>::f a) {
    using F = typename V<W>::f;
    using I = typename V<W>::i;
    const F u = z * a;
    const I sign = (I)u & (I{} + INT32_MIN);
    const F au = (F)((I)u & 0x7fffffff);
    const F u2 = u * u;
    F p = splat<W>(-5.70498872745e-3f);
    p = p * u2 + splat<W>(2.06390887954e-2f);
    p = p * u2 + splat<W>(-5.37397155531e-2f);
    p = p * u2 + splat<W>(1.33314422036e-1f);
    p = p * u2 + splat<W>(-3.33332819422e-1f);
    const F small = p * u2 * u + u;
    const F e = exp_neg<W>(splat<W>(-2.0f) * au);
    const F big = (F)((I)((splat<W>(1.0f) - e) / (splat<W>(1.0f) + e)) | sign);
    const F w = au < splat<W>(0.625f) ? small : big;
    return u == u ? w : u;
}

// One IEEE half (bits h) as float: normal, subnormal, zero, inf, NaN (payload kept).
ICQS_SIMD_INLINE float half_bits_to_float(uint32_t h) {
    const uint32_t mag = h & 0x7fffu, expo = h & 0x7c00u;
    uint32_t out;
    if (expo == 0x7c00u) {
        out = (mag << 13) | 0x7f800000u;
    } else if (expo == 0u) {
        const float sub = static_cast<float>(mag) * 5.9604644775390625e-8f;  // 2^-24
        std::memcpy(&out, &sub, sizeof(out));
    } else {
        out = (mag << 13) + ((127u - 15u) << 23);
    }
    out |= (h & 0x8000u) << 16;
    float f;
    std::memcpy(&f, &out, sizeof(f));
    return f;
}

// The ISA level of the per-ISA kernels this CPU runs: 2 x86-64-v4 (AVX-512, W = 16),
// 1 x86-64-v3 (AVX2 + FMA, W = 8), 0 the build's x86-64-v2 (W = 4; also every non-x86 build
// and -DICQS_FAST_GENERIC_ONLY).
inline int cpu_isa_level() {
#if defined(__x86_64__) && !defined(ICQS_FAST_GENERIC_ONLY)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return 2;
    if (__builtin_cpu_supports("x86-64-v3")) return 1;
#endif
    return 0;
}

// The ISA level a kernel call runs: the CPU's best for isa < 0, else isa (above the best: an
// invalid_argument, which pybind11 raises as ValueError).
inline int pick_isa(int isa) {
    const int best = cpu_isa_level();
    if (isa < 0) return best;
    if (isa > best)
        throw std::invalid_argument("isa " + std::to_string(isa) +
                                    " is not supported by this CPU (best: " +
                                    std::to_string(best) + ")");
    return isa;
}

#if defined(__x86_64__) && !defined(ICQS_FAST_GENERIC_ONLY)
// 16 fp32 values' bf16 bits (the low half of each 32-bit lane): round to nearest even in
// integers, NaN kept quiet, subnormals kept (the conversion instruction flushes them): the
// scalar conversions' bits.
__attribute__((target("arch=x86-64-v4"))) ICQS_SIMD_INLINE __m512i bf16_rne16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i up = _mm512_srli_epi32(u, 16);
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                         _mm512_and_si512(up, _mm512_set1_epi32(1))),
        16);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(up, _mm512_set1_epi32(0x40)));
}

// All 8 AMX tiles as 16 rows x 64 bytes (palette 1): the one shape the kernels use (16 x 16
// fp32 outputs, 16 rows x 32 bf16 operands).
__attribute__((target("arch=x86-64-v4,amx-tile"))) ICQS_SIMD_INLINE void amx_config_16x64() {
    struct {
        uint8_t palette_id, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg{};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    // GCC does not count ldtilecfg as a read of the config: without this barrier it dropped
    // the rows / colsb stores in a function of its own (a fault on the first tile load).
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}
#endif

// 64-byte aligned storage for the kernels' buffers: malloc aligns to 16 bytes, and a row of an
// AMX tile or an AVX-512 vector that straddles two cache lines costs two loads.
template <class T>
struct Aligned64 {
    using value_type = T;
    Aligned64() = default;
    template <class U>
    Aligned64(const Aligned64<U>&) {}
    T* allocate(size_t n) {
        return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
    }
    void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
    template <class U>
    bool operator==(const Aligned64<U>&) const { return true; }
    template <class U>
    bool operator!=(const Aligned64<U>&) const { return false; }
};
template <class T>
using AlignedVec = std::vector<T, Aligned64<T>>;

// Whether this process may run AMX tile instructions (bf16 tiles): the CPU has them and Linux
// granted the tile state, which it hands a process only on request (ARCH_REQ_XCOMP_PERM for
// XTILEDATA). The grant is the process's, so asking again is harmless.
inline bool cpu_has_amx() {
#if defined(__x86_64__) && !defined(ICQS_FAST_GENERIC_ONLY) && defined(__linux__)
    static const bool ok = [] {
        __builtin_cpu_init();
        if (!__builtin_cpu_supports("avx512bw")) return false;
        unsigned eax, ebx, ecx, edx;
        __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
        const bool tile = (edx >> 24) & 1u, bf16 = (edx >> 22) & 1u;
        if (!tile || !bf16) return false;
        return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }();
    return ok;
#else
    return false;
#endif
}

}  // namespace

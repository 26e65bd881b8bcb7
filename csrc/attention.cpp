// Flash-style softmax attention with log-sum-exp output for the cpp backend of
// ops.attention_lse (icqs_fast._C.attention_lse), the CPU path of cascade attention.
//
// out[b, h, i, :] = sum_j p_ij v[b, h // group, j, :],  p_ij = e^{s_ij - lse_i},
// s_ij = scale * q_i . k_j (then c tanh(s / c) with a soft cap c), lse_i = log sum_j e^{s_ij}
// over the allowed keys j: key position kpos_j >= 0 (a negative position is a masked / padded
// key), and with `causal` kpos_j <= qpos_i, with `window` w qpos_i - kpos_j < w, with `chunk`
// c floor(kpos_j / c) == floor(qpos_i / c). Positions default to qpos_i = Tk - Tq + i (queries
// at the last Tq key slots) and kpos_j = j. A row with no allowed key gets lse = -inf and
// output 0 (it then drops out of an LSE merge exactly).
//
// No torch headers: Python passes raw pointers and element strides and allocates the fp32
// outputs. Work items are (batch, key head, a range of the key head's `group * Tq` query rows):
// each thread packs its item's keys (transposed, fp32, zero-padded to whole key blocks) and
// values (fp32, value rows padded to whole vectors; masked keys zeroed, so a NaN in a padded
// slot never reaches the output) into thread-local buffers, reused while consecutive items
// share the key head. Per block of kBQ query rows it walks the key blocks of kBK = 4W keys with
// an online softmax: S = Q K^T (register tile of R rows x 4 vectors, broadcast q, FMA along the
// key block, each key vector loaded once per step), scale / soft cap / mask into log2 units,
// running max and sum in fp32 (updated W rows at a time, no branch on a row's max changing;
// probabilities by exp2_neg), O = O alpha + P V (register tile of R rows x up to 4 vectors of
// value columns, the factor alpha applied as O is loaded). Key blocks a query block cannot see
// (causal, window, chunk, all padded) are skipped, blocks it sees entirely need no mask, and of
// a block it sees in part the fp32 kernel computes only the key vectors up to the last key some
// row may see (a short suffix's keys, the causal diagonal). With positions to compare a query
// block holds one query head's rows. None of this changes a row's sums: a row's output is bit
// for bit the same whatever rows share its block. The fp32 and bf16 kernels share that loop
// (item_impl) and differ in packing and in the two products (KF32, KBf16).
//
// bf16 inputs on CPUs with AVX512_BF16: keys and values are packed as bf16 pairs and both
// products run on _mm512_dpbf16_ps (fp32 accumulation; the probabilities enter the PV product
// as bf16, as in any flash attention with 16-bit inputs). With AMX, at the CPU's own best ISA
// level and head sizes a multiple of 32, the same layouts feed AMX tiles instead (KAmx): the
// same softmax loop, 1.5-2.3x faster on the cascade's shapes. Elsewhere 16-bit inputs are widened
// to fp32 at packing time and run the fp32 kernel. With round_bf16 (ops.attention_lse's
// dot_dtype=bfloat16: mixed precision, fp32 activations with bf16 products) inputs of any dtype
// are rounded to bf16 at packing time and take the same bf16 path (or, widened back, the fp32
// one).
//
// ISA levels as in token_stats.cpp: a template on the vector width W with per-function target
// attributes (x86-64-v4 W = 16, x86-64-v3 W = 8, the build's x86-64-v2 W = 4), picked at run
// time or forced by the isa argument (ICQS_FAST_CPP_ISA on the Python side).

#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "simd_math.h"

#if defined(__x86_64__) && !defined(ICQS_FAST_GENERIC_ONLY)
#include <immintrin.h>
#define ICQS_ATTN_X86 1
#endif

namespace py = pybind11;

#pragma GCC diagnostic ignored "-Wpsabi"

namespace {

#define ATTN_INLINE inline __attribute__((always_inline))

enum ADType : int { kAF32 = 0, kAF16 = 1, kABF16 = 2 };

constexpr double kLog2e = 1.4426950408889634;

template <int W>
ATTN_INLINE typename V<W>::f aload(const float* p) {
    typename V<W>::f x;
    std::memcpy(&x, p, sizeof(x));
    return x;
}

template <int W>
ATTN_INLINE void astore(float* p, typename V<W>::f x) {
    std::memcpy(p, &x, sizeof(x));
}

// Keeps a loaded vector in a register: the empty asm "changes" x, so the compiler cannot fold
// its load into every FMA that uses it (it did: R loads of the same key / value vector per
// step, 20 loads per 16 FMAs in the 4 x 4 tiles, which made the tiles load-bound).
template <class T>
ATTN_INLINE T in_register(T x) {
#if defined(__x86_64__)
    asm("" : "+v"(x));
#endif
    return x;
}

// Horizontal max / sum by halving (log2(W) vector steps, not W scalar ones).
template <int W>
ATTN_INLINE float hmax(typename V<W>::f x) {
    if constexpr (W == 4) {
        const float a = x[0] > x[1] ? x[0] : x[1], b = x[2] > x[3] ? x[2] : x[3];
        return a > b ? a : b;
    } else {
        typename V<W / 2>::f lo, hi;
        std::memcpy(&lo, &x, sizeof(lo));
        std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(lo), sizeof(hi));
        return hmax<W / 2>(lo > hi ? lo : hi);
    }
}

template <int W>
ATTN_INLINE float hsum(typename V<W>::f x) {
    if constexpr (W == 4) {
        return (x[0] + x[2]) + (x[1] + x[3]);
    } else {
        typename V<W / 2>::f lo, hi;
        std::memcpy(&lo, &x, sizeof(lo));
        std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(lo), sizeof(hi));
        return hsum<W / 2>(lo + hi);
    }
}

ATTN_INLINE float to_f32(const void* base, int64_t idx, int dt) {
    if (dt == kAF32) return static_cast<const float*>(base)[idx];
    const uint32_t h = static_cast<const uint16_t*>(base)[idx];
    if (dt == kAF16) return half_bits_to_float(h);
    const uint32_t out = h << 16;
    float f;
    std::memcpy(&f, &out, sizeof(f));
    return f;
}

// fp32 -> bf16, round to nearest even (NaN kept quiet).
ATTN_INLINE uint16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// Element idx as bf16 bits: bf16 inputs as they are, others rounded (the bf16 dot products of
// fp32 inputs with round_bf16).
ATTN_INLINE uint32_t bf16_bits(const void* base, int64_t idx, int dt) {
    if (dt == kABF16) return static_cast<const uint16_t*>(base)[idx];
    return to_bf16(to_f32(base, idx, dt));
}

// Element idx as fp32, rounded through bf16 first with `round` (the widened path of round_bf16).
ATTN_INLINE float load_f32(const void* base, int64_t idx, int dt, bool round) {
    const float x = to_f32(base, idx, dt);
    if (!round || dt == kABF16) return x;
    const uint32_t u = static_cast<uint32_t>(to_bf16(x)) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}

ATTN_INLINE int64_t floor_div(int64_t a, int64_t b) {
    const int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

struct Args {
    const void *q, *k, *v;
    int64_t qs[3], ks[3], vs[3];  // element strides of dims 0..2 (the last dim is contiguous)
    float* out;                   // [B, Hq, Tq, Dv] fp32, contiguous
    float* lse;                   // [B, Hq, Tq] fp32, contiguous, or null (not computed)
    const int64_t* qpos;          // [B, Tq] or null (Tk - Tq + i)
    const int64_t* kpos;          // [B, Tk] or null (j); negative = masked key
    int64_t B, Hq, Hk, Tq, Tk, D, Dv;
    int dt;
    bool causal;
    int64_t window, chunk;  // 0 = none
    float scale, softcap;   // softcap 0 = none
    float scale_log2, softcap_log2;  // scale, softcap times log2(e): scores in log2 units
    bool round_bf16;        // q, k, v rounded to bf16 for the products (accumulation fp32)
    uint64_t call;          // id of this call (thread-local packed buffers are per call)
    const float* state_in;  // [B, Hq, Tq, kStateLanes + 1 + Dv] running state to resume, or null
    float* state_out;       // the same layout: written instead of out / lse, or null
    bool token_major;       // out as [B, Tq, Hq, Dv] (a model's layout after attention)
    bool out_bf16;          // out as bf16 bits (each fp32 output rounded to nearest even)
    const int64_t* kbatch;  // [B]: the key batch (of k, v, kpos) of each query batch, or null (b)
};

// A query row's running softmax state (state_in / state_out): the running max (log2 units),
// the running sum's W lanes (kStateLanes slots; the kernel's W of them used) and the
// unnormalised output [Dv]. A call that resumes one continues the same online softmax as if its
// keys had followed the first call's in one call: with the first call's keys ending on a key
// block boundary (a multiple of 64 keys holds for every kernel), the same bits.
constexpr int kStateLanes = 16;

// Per-thread packed keys/values of one (batch, key head), and the query-block scratch.
struct Scratch {
    AlignedVec<float> kt, vp, qb, sb, ob;
    AlignedVec<uint32_t> kt2, vp2, qb2, pb2;  // bf16-pair layouts
    AlignedVec<uint16_t> row2;                // one key's and value's bf16 (pack_bf16)
    std::vector<int32_t> kp;                   // key positions (-1 = masked), per key slot
    std::vector<int32_t> binfo;                // per key block: n valid, kmin, kmax, all valid
    uint64_t call = ~uint64_t(0);
    int64_t b = -1, hk = -1;
};

Scratch& scratch() {
    static thread_local Scratch s;
    return s;
}

constexpr int kBQ = 32;  // query rows per block (a multiple of every register tile's rows)

// Key positions and per-block facts of (b, hk) (shared by both kernels).
ATTN_INLINE void pack_positions(const Args& a, Scratch& s, int64_t b, int BK, int64_t nkb) {
    s.kp.assign(static_cast<size_t>(nkb * BK), -1);
    s.binfo.assign(static_cast<size_t>(nkb * 4), 0);
    for (int64_t j = 0; j < a.Tk; ++j) {
        const int64_t p = a.kpos ? a.kpos[b * a.Tk + j] : j;
        s.kp[j] = p < 0 ? -1 : static_cast<int32_t>(std::min<int64_t>(p, INT32_MAX));
    }
    for (int64_t kb = 0; kb < nkb; ++kb) {
        int32_t n = 0, lo = INT32_MAX, hi = INT32_MIN;
        for (int jj = 0; jj < BK; ++jj) {
            const int32_t p = s.kp[kb * BK + jj];
            if (p < 0) continue;
            ++n;
            lo = std::min(lo, p);
            hi = std::max(hi, p);
        }
        int32_t* bi = &s.binfo[kb * 4];
        bi[0] = n;
        bi[1] = lo;
        bi[2] = hi;
        bi[3] = n == BK;
    }
}

// 0: the query block sees none of the key block, 1: part of it (mask each score), 2: all of it.
ATTN_INLINE int classify(const Args& a, const int32_t* bi, int64_t qmin, int64_t qmax) {
    if (bi[0] == 0) return 0;
    const int64_t kmin = bi[1], kmax = bi[2];
    if (a.causal && kmin > qmax) return 0;
    if (a.window && kmax <= qmin - a.window) return 0;
    if (a.chunk && (floor_div(kmax, a.chunk) < floor_div(qmin, a.chunk) ||
                    floor_div(kmin, a.chunk) > floor_div(qmax, a.chunk)))
        return 0;
    bool full = bi[3] != 0;
    if (a.causal && kmax > qmin) full = false;
    if (a.window && kmin <= qmax - a.window) full = false;
    if (a.chunk) {
        const int64_t c = floor_div(kmin, a.chunk);
        if (floor_div(kmax, a.chunk) != c || floor_div(qmin, a.chunk) != c ||
            floor_div(qmax, a.chunk) != c)
            full = false;
    }
    return full ? 2 : 1;
}

// Query rows of one block: row r of the key head's grouped rows is query head hk * group +
// r / Tq, position r % Tq.
struct QRows {
    int64_t head[kBQ], i[kBQ], pos[kBQ];
    int n;
    int64_t qmin, qmax;
};

ATTN_INLINE void query_rows(const Args& a, int64_t b, int64_t hk, int64_t r, int n, QRows& q) {
    const int64_t group = a.Hq / a.Hk;
    q.n = n;
    q.qmin = INT64_MAX;
    q.qmax = INT64_MIN;
    // (head, position) stepped along the rows: one division per block, not one per row (a
    // 64-bit division per row was a tenth of a short-suffix call).
    int64_t g = r / a.Tq, i = r % a.Tq;
    for (int rr = 0; rr < n; ++rr) {
        q.head[rr] = hk * group + g;
        q.i[rr] = i;
        q.pos[rr] = a.qpos ? a.qpos[b * a.Tq + i] : a.Tk - a.Tq + i;
        q.qmin = std::min(q.qmin, q.pos[rr]);
        q.qmax = std::max(q.qmax, q.pos[rr]);
        if (++i == a.Tq) i = 0, ++g;
    }
}

// One row's scores srow[0..NV W) of a key block (its first NV vectors: the key slots past them
// are seen by no row of the query block), in place: scaled into log2 units (scale times log2 e
// in one multiply, so the probabilities are exp2_neg's: fewer operations than e^x), soft
// capped, masked (-inf) where mode == 1; returns the row's largest.
template <int W, int NV>
ATTN_INLINE float row_scores(const Args& a, float* srow, const int32_t* kp, int64_t qp,
                             int mode) {
    using F = typename V<W>::f;
    using I = typename V<W>::i;
    const F ninf = splat<W>(-std::numeric_limits<float>::infinity());
    F s[NV];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
        if (a.softcap != 0.f)
            s[c] = tanh_scaled<W>(aload<W>(srow + c * W) * splat<W>(a.scale),
                                  splat<W>(1.0f / a.softcap)) * splat<W>(a.softcap_log2);
        else
            s[c] = aload<W>(srow + c * W) * splat<W>(a.scale_log2);
    }
    if (mode == 1) {
        // The mask as one allowed key-position range [lo, hi] of this query (key positions
        // are int32, >= 0 when real): causal hi = qp; window lo = qp - window + 1; chunk its
        // bounds.
        int64_t lo = 0, hi = INT32_MAX;
        if (a.causal) hi = std::min<int64_t>(hi, qp);
        if (a.window) lo = std::max<int64_t>(lo, qp - a.window + 1);
        if (a.chunk) {
            const int64_t c0 = floor_div(qp, a.chunk) * a.chunk;
            lo = std::max<int64_t>(lo, c0);
            hi = std::min<int64_t>(hi, c0 + a.chunk - 1);
        }
        if (lo > hi) lo = 1, hi = 0;  // no key position: an empty range
        // Outside [lo, hi] exactly when kv - lo or hi - kv is negative (lo in [0, 2^31),
        // hi and kv in [-1, 2^31): the differences fit 32 bits, wrapping only at kv = -1, which
        // kv - lo rejects). Sign bits and bit masks, not vector compares and selects: GCC
        // turned those into a compare and a branch per lane (a quarter of the kernel's time
        // on padded keys).
        using U = typename V<W>::u;
        const U ulo = U{} + static_cast<uint32_t>(std::min<int64_t>(lo, INT32_MAX));
        const U uhi = U{} + static_cast<uint32_t>(std::max<int64_t>(hi, -1));
        const I ninf_bits = (I)ninf;
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) {
            U kv;
            std::memcpy(&kv, kp + c * W, sizeof(kv));
            const I out = (I)((kv - ulo) | (uhi - kv)) >> 31;  // all ones where masked
            s[c] = (F)(((I)s[c] & ~out) | (ninf_bits & out));
        }
    }
    F mx = s[0];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
        astore<W>(srow + c * W, s[c]);
        mx = mx > s[c] ? mx : s[c];
    }
    return hmax<W>(mx);
}

// The online softmax of a query block over one more key block, rows [0, kBQ) W at a time
// (branch-free: a row's max changing is data, not control flow): the running max m (log2
// units) becomes max(m, bm); alpha = 2^(m_old - m_new) is the factor the row's output and
// sum are multiplied by (0 for a row's first allowed scores, 1 while the max stays); msub the
// max to subtract (0 for a row with nothing allowed yet, whose scores are all -inf: then its
// probabilities are 2^-inf = 0, not NaN).
template <int W>
ATTN_INLINE void rescale_rows(float* m, const float* bm, float* alpha, float* msub) {
    using F = typename V<W>::f;
    const F ninf = splat<W>(-std::numeric_limits<float>::infinity());
    for (int rr = 0; rr < kBQ; rr += W) {
        const F mo = aload<W>(m + rr), b = aload<W>(bm + rr);
        const F mn = mo > b ? mo : b;
        const auto dead = mn == ninf;
        astore<W>(alpha + rr, exp2_neg<W>(dead ? F{} : mo - mn));
        astore<W>(msub + rr, dead ? F{} : mn);
        astore<W>(m + rr, mn);
    }
}

// A row's probabilities 2^(s - msub) in place (its first NV vectors); its running sum lv (W
// lanes, reduced once at the end: no horizontal sum per key block) becomes lv alpha + their
// sum (the vectors past NV would add exact zeros).
template <int W, int NV>
ATTN_INLINE void row_probs(float* srow, float msub, float alpha, float* lv) {
    using F = typename V<W>::f;
    const F vm = splat<W>(msub);
    F sum = F{};
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
        const F p = exp2_neg<W>(aload<W>(srow + c * W) - vm);
        astore<W>(srow + c * W, p);
        sum += p;
    }
    astore<W>(lv, aload<W>(lv) * splat<W>(alpha) + sum);
}

// ------------------------------------------------------------------------------ fp32 kernel

template <int W>
struct Tile {
    static constexpr int BK = 4 * W;           // keys per block: 4 vectors
    static constexpr int RS = W == 16 ? 4 : 2;  // query rows of the S register tile
    static constexpr int RP = W == 16 ? 4 : 2;  // query rows of the PV register tile
};

// Interleaves of two vectors' low / high halves: (a0 b0 a1 b1 ...) / (a_{W/2} b_{W/2} ...).
template <int W, size_t... I>
ATTN_INLINE typename V<W>::f zip_lo(typename V<W>::f x, typename V<W>::f y,
                                    std::index_sequence<I...>) {
    return __builtin_shufflevector(x, y, (I % 2 ? W + I / 2 : I / 2)...);
}
template <int W, size_t... I>
ATTN_INLINE typename V<W>::f zip_hi(typename V<W>::f x, typename V<W>::f y,
                                    std::index_sequence<I...>) {
    return __builtin_shufflevector(x, y, (I % 2 ? W + W / 2 + I / 2 : W / 2 + I / 2)...);
}

// dst[d * dstride + i] = src[i * sstride + d] for a W x W block, in registers: log2(W) rounds
// of zipping row i with row i + W/2 (each round moves one bit of the row index into the column
// index), then one store per column (a scalar transposition stores every element alone).
template <int W>
ATTN_INLINE void transpose_block(const float* src, int64_t sstride, float* dst,
                                 int64_t dstride) {
    using F = typename V<W>::f;
    constexpr auto idx = std::make_index_sequence<W>{};
    F r[W], t[W];
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) r[i] = aload<W>(src + i * sstride);
#pragma GCC unroll 4
    for (int h = 1; h < W; h *= 2) {
#pragma GCC unroll 8
        for (int i = 0; i < W / 2; ++i) {
            t[2 * i] = zip_lo<W>(r[i], r[i + W / 2], idx);
            t[2 * i + 1] = zip_hi<W>(r[i], r[i + W / 2], idx);
        }
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) r[i] = t[i];
    }
#pragma GCC unroll 16
    for (int d = 0; d < W; ++d) astore<W>(dst + d * dstride, r[d]);
}

// Keys transposed as [block][D][BK] and values as [key slot][dvp], fp32. The value of every
// slot past Tk or masked is zero (so a NaN in an unused bank slot never reaches the output:
// its probability 0 times it adds nothing), as are the value columns past Dv; such a slot's
// key is not written (a block with one is masked, and the mask replaces its score's bits,
// whatever they were: zeroing it cost a strided store per dimension). fp32 inputs that are not
// rounded are copied as they are, without a dtype dispatch per element: values a row at a time,
// keys W x W blocks at a time where W consecutive slots all hold real keys.
template <int W>
ATTN_INLINE void pack_f32(const Args& a, Scratch& s, int64_t b, int64_t hk, int64_t nkb,
                          int64_t dvp) {
    constexpr int BK = Tile<W>::BK;
    const int64_t D = a.D, Dv = a.Dv, slots = nkb * BK;
    pack_positions(a, s, b, BK, nkb);
    s.kt.resize(static_cast<size_t>(slots * D));
    s.vp.resize(static_cast<size_t>(slots * dvp));
    const int64_t kbase = b * a.ks[0] + hk * a.ks[1], vbase = b * a.vs[0] + hk * a.vs[1];
    const bool plain = a.dt == kAF32 && !a.round_bf16;
    const float* kf = static_cast<const float*>(a.k);
    for (int64_t j0 = 0; j0 < slots; j0 += W) {
        float* kt0 = s.kt.data() + (j0 / BK) * D * BK + j0 % BK;
        bool whole = plain;
        for (int jj = 0; jj < W && whole; ++jj) whole = s.kp[j0 + jj] >= 0;
        int64_t d0 = 0;
        if (whole) {  // W real keys: their whole W-wide dim groups by register transposes
            for (; d0 + W <= D; d0 += W)
                transpose_block<W>(kf + kbase + j0 * a.ks[2] + d0, a.ks[2], kt0 + d0 * BK, BK);
        }
        for (int jj = 0; jj < W; ++jj) {
            const int64_t j = j0 + jj;
            float* kt = kt0 + jj;
            float* vr = s.vp.data() + j * dvp;
            if (s.kp[j] < 0) {  // masked or past Tk: zero value, key left as it was
                std::fill(vr, vr + dvp, 0.f);
                continue;
            }
            const int64_t ko = kbase + j * a.ks[2], vo = vbase + j * a.vs[2];
            if (plain) {
                for (int64_t d = d0; d < D; ++d) kt[d * BK] = kf[ko + d];
                std::memcpy(vr, static_cast<const float*>(a.v) + vo, sizeof(float) * Dv);
            } else {
                for (int64_t d = 0; d < D; ++d)
                    kt[d * BK] = load_f32(a.k, ko + d, a.dt, a.round_bf16);
                for (int64_t c = 0; c < Dv; ++c) vr[c] = load_f32(a.v, vo + c, a.dt, a.round_bf16);
            }
            std::fill(vr + Dv, vr + dvp, 0.f);
        }
    }
}

// S[R rows][NK vectors of keys] = Q . Kt (D x BK), register tile. q is the tile's rows
// interleaved, q[d * R + r] (one pointer, small offsets, for the R broadcasts of a step); each
// key vector is loaded once per step and kept in a register for its R FMAs. Each score is the
// same d-ordered FMA chain whatever R, NK or the other rows.
template <int W, int R, int NK>
ATTN_INLINE void qk_tile(const float* q, int64_t D, const float* kt, float* srow) {
    using F = typename V<W>::f;
    constexpr int BK = Tile<W>::BK;
    F acc[R][NK];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NK; ++c) acc[r][c] = F{};
    for (int64_t d = 0; d < D; ++d) {
        const float* kr = kt + d * BK;
        F kv[NK];
#pragma GCC unroll 4
        for (int c = 0; c < NK; ++c) kv[c] = in_register(aload<W>(kr + c * W));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const float qv = q[d * R + r];  // scalar * vector: one broadcast (no 0 + q)
#pragma GCC unroll 4
            for (int c = 0; c < NK; ++c) acc[r][c] += qv * kv[c];
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NK; ++c) astore<W>(srow + r * BK + c * W, acc[r][c]);
}

// O[R rows][NC vectors at column c0] = O alpha + P[R rows][0..nj) . V[0..nj)[c0..], register
// tile (alpha: each row's online-softmax factor, applied as O is loaded; the key slots past nj
// have probability 0 for every row of the block, so leaving them out changes no sum). Each
// value vector is loaded once per key and kept in a register for its R FMAs.
template <int W, int R, int NC>
ATTN_INLINE void pv_tile(const float* p, const float* v, int64_t dvp, const float* alpha,
                         float* o, int nj) {
    using F = typename V<W>::f;
    constexpr int BK = Tile<W>::BK;
    F acc[R][NC];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) acc[r][c] = aload<W>(o + r * dvp + c * W) * splat<W>(alpha[r]);
    for (int j = 0; j < nj; ++j) {
        F vv[NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) vv[c] = in_register(aload<W>(v + j * dvp + c * W));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const float pr = p[r * BK + j];
#pragma GCC unroll 4
            for (int c = 0; c < NC; ++c) acc[r][c] += pr * vv[c];
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) astore<W>(o + r * dvp + c * W, acc[r][c]);
}

// Rows [0, n) of the block hold queries: only their tiles run (a block's last tile may be part
// padding, whose probabilities are 0); rows past the last tile are never read.
template <int W>
ATTN_INLINE void pv_rows(const float* p, const float* v, int64_t dvp, const float* alpha,
                         float* o, int n, int nj) {
    constexpr int RP = Tile<W>::RP, BK = Tile<W>::BK;
    const int64_t nv = dvp / W;
    const int nr = (n + RP - 1) / RP * RP;
    for (int r = 0; r < nr; r += RP) {
        const float *pr = p + r * BK, *al = alpha + r;
        float* orow = o + r * dvp;
        int64_t c = 0;
        for (; c + 4 <= nv; c += 4) pv_tile<W, RP, 4>(pr, v + c * W, dvp, al, orow + c * W, nj);
        switch (nv - c) {
            case 3: pv_tile<W, RP, 3>(pr, v + c * W, dvp, al, orow + c * W, nj); break;
            case 2: pv_tile<W, RP, 2>(pr, v + c * W, dvp, al, orow + c * W, nj); break;
            case 1: pv_tile<W, RP, 1>(pr, v + c * W, dvp, al, orow + c * W, nj); break;
            default: break;
        }
    }
}

// ------------------------------------------------------------------ one loop, both kernels

// The softmax part of a query block against one key block whose first NV vectors of key slots
// some row sees: scores into log2 units (masked where mode == 1), the online rescale, the
// probabilities and running sums (rows [0, n)).
template <int W, int NV>
ATTN_INLINE void softmax_block(const Args& a, float* sb, int BK, const int32_t* kp,
                               const QRows& qr, int mode, float* m, float* bm, float* alpha,
                               float* msub, float* lv) {
    const int n = qr.n;
    for (int rr = 0; rr < n; ++rr)
        bm[rr] = row_scores<W, NV>(a, sb + rr * BK, kp, qr.pos[rr], mode);
    rescale_rows<W>(m, bm, alpha, msub);
    for (int rr = 0; rr < n; ++rr) row_probs<W, NV>(sb + rr * BK, msub[rr], alpha[rr], lv + rr * W);
}

// The key slots [0, extent) of a block that a query block needs: past the last slot holding a
// real key that some row of the block may see (causal: position <= the block's largest), every
// row's probability is 0 (a short suffix's block past Tk, the causal diagonal). Only skips work:
// it depends on the block's rows, but a row's sums are the same with or without those zeros.
ATTN_INLINE int key_extent(const Args& a, const int32_t* kp, int BK, int64_t qmax) {
    int e = BK;
    while (e > 0 && (kp[e - 1] < 0 || (a.causal && kp[e - 1] > qmax))) --e;
    return e;
}

// Rows [r0, r1) of key head hk of batch b, for a kernel K (KF32<W>, KBf16): K packs the keys
// and values of (b, hk) and the query rows, computes a query block's scores against a key block
// (S, kBQ x BK fp32), turns the block's probabilities into its PV operand and accumulates
// O += P V; this loop does the rest (blocks to skip or mask, the online softmax, the output).
// With positions to compare (causal, window, chunk) a query block holds one query head's rows
// only (a block spanning two heads' positions would see the union of their keys). K::kExtent:
// K computes a block's first key vectors only (key_extent), else all of them.
template <class K>
ATTN_INLINE void item_impl(const Args& a, int64_t b, int64_t hk, int64_t r0, int64_t r1) {
    constexpr int W = K::W, BK = K::BK;
    Scratch& s = scratch();
    const int64_t nkb = (a.Tk + BK - 1) / BK, dq = K::q_len(a.D), Dv = a.Dv;
    const int64_t dvp = (Dv + W - 1) / W * W;
    const int64_t kbt = a.kbatch ? a.kbatch[b] : b;  // the keys' batch (packed once per thread)
    if (s.call != a.call || s.b != kbt || s.hk != hk) {
        K::pack(a, s, kbt, hk, nkb, dvp);
        s.call = a.call;
        s.b = kbt;
        s.hk = hk;
    }
    auto& qbuf = K::q_buf(s);
    qbuf.resize(static_cast<size_t>(kBQ * dq));
    s.sb.resize(static_cast<size_t>(kBQ * BK));
    s.ob.resize(static_cast<size_t>(kBQ * dvp));
    K::prepare(s);
    auto* qb = qbuf.data();
    float *sb = s.sb.data(), *ob = s.ob.data();
    // With positions to compare, a block of rows spanning two query heads sees the union of
    // their positions' keys (more key blocks masked than skipped): kept to one head's rows
    // unless a head has fewer rows than a block (short suffixes), where spanning fills the
    // tiles. Either way each row's bits: a fully masked block is the same as a skipped one.
    const bool by_head = (a.causal || a.window || a.chunk) && a.Tq >= kBQ;
    // Per query row: running max (log2 units), running sum (W lanes); per key block: the
    // rows' block max, output factor, max to subtract (rows past n: -inf, 1, 0).
    alignas(64) float m[kBQ], bm[kBQ], alpha[kBQ], msub[kBQ];
    alignas(64) float lv[kBQ * W];
    QRows qr;
    for (int64_t r = r0, n = 0; r < r1; r += n) {
        n = std::min<int64_t>(kBQ, r1 - r);
        if (by_head) n = std::min<int64_t>(n, a.Tq - r % a.Tq);
        query_rows(a, b, hk, r, static_cast<int>(n), qr);
        // Only what the block's rows read is cleared: the padding rows of its last tile (up to
        // a multiple of 4) keep stale queries, whose scores are never used and whose
        // probabilities K::pv sets to 0.
        const int n4 = static_cast<int>(std::min<int64_t>(kBQ, (n + 3) / 4 * 4));
        for (int rr = 0; rr < n; ++rr)
            K::load_q(a, b * a.qs[0] + qr.head[rr] * a.qs[1] + qr.i[rr] * a.qs[2], qb, rr, dq);
        std::fill(m, m + kBQ, -std::numeric_limits<float>::infinity());
        std::fill(bm, bm + kBQ, -std::numeric_limits<float>::infinity());
        std::fill(lv, lv + n * W, 0.f);
        std::fill(ob, ob + n4 * dvp, 0.f);
        const int64_t sw = kStateLanes + 1 + Dv;
        if (a.state_in != nullptr) {
            for (int rr = 0; rr < n; ++rr) {
                const float* st = a.state_in + ((b * a.Hq + qr.head[rr]) * a.Tq + qr.i[rr]) * sw;
                m[rr] = st[0];
                std::copy(st + 1, st + 1 + W, lv + rr * W);
                std::copy(st + 1 + kStateLanes, st + 1 + kStateLanes + Dv, ob + rr * dvp);
            }
        }
        for (int64_t kb = 0; kb < nkb; ++kb) {
            const int mode = classify(a, &s.binfo[kb * 4], qr.qmin, qr.qmax);
            if (mode == 0) continue;
            const int32_t* kp = s.kp.data() + kb * BK;
            const int ext = K::kExtent && mode == 1 ? key_extent(a, kp, BK, qr.qmax) : BK;
            if (ext == 0) continue;  // no row sees a key of this block: the same as skipping
            const int nv = (ext + W - 1) / W;
            K::scores(s, qb, dq, kb, sb, qr.n, nv);
            switch (nv) {
                case 1: softmax_block<W, 1>(a, sb, BK, kp, qr, mode, m, bm, alpha, msub, lv); break;
                case 2: softmax_block<W, 2>(a, sb, BK, kp, qr, mode, m, bm, alpha, msub, lv); break;
                case 3: softmax_block<W, 3>(a, sb, BK, kp, qr, mode, m, bm, alpha, msub, lv); break;
                default: softmax_block<W, 4>(a, sb, BK, kp, qr, mode, m, bm, alpha, msub, lv); break;
            }
            K::pv(s, sb, qr.n, kb, dvp, alpha, ob, ext);
        }
        if (a.state_out != nullptr) {
            for (int rr = 0; rr < n; ++rr) {
                float* st = a.state_out + ((b * a.Hq + qr.head[rr]) * a.Tq + qr.i[rr]) * sw;
                st[0] = m[rr];
                std::copy(lv + rr * W, lv + rr * W + W, st + 1);
                std::fill(st + 1 + W, st + 1 + kStateLanes, 0.f);
                std::copy(ob + rr * dvp, ob + rr * dvp + Dv, st + 1 + kStateLanes);
            }
            continue;
        }
        for (int rr = 0; rr < n; ++rr) {
            const int64_t row = (b * a.Hq + qr.head[rr]) * a.Tq + qr.i[rr];
            const int64_t at = (a.token_major ? (b * a.Tq + qr.i[rr]) * a.Hq + qr.head[rr] : row) * Dv;
            float* dst = a.out + at;
            uint16_t* dst16 = reinterpret_cast<uint16_t*>(a.out) + at;
            const float l = hsum<W>(aload<W>(lv + rr * W));
            if (l > 0.f) {
                const float inv = 1.0f / l;
                if (a.out_bf16)  // the rounding a bf16-products linear gives its fp32 input
                    for (int64_t c = 0; c < Dv; ++c) dst16[c] = to_bf16(ob[rr * dvp + c] * inv);
                else
                    for (int64_t c = 0; c < Dv; ++c) dst[c] = ob[rr * dvp + c] * inv;
                if (a.lse != nullptr)  // a double log per row: a tenth of a short call
                    a.lse[row] =
                        static_cast<float>((m[rr] + std::log2(static_cast<double>(l))) / kLog2e);
            } else {
                if (a.out_bf16)
                    std::fill(dst16, dst16 + Dv, uint16_t{0});
                else
                    std::fill(dst, dst + Dv, 0.f);
                if (a.lse != nullptr) a.lse[row] = -std::numeric_limits<float>::infinity();
            }
        }
    }
}

// The fp32 kernel's parts for item_impl (generic vector code: compiled for each ISA level).
// The query block is held as its S tiles' rows interleaved (qk_tile's layout).
template <int W_>
struct KF32 {
    static constexpr int W = W_, BK = Tile<W>::BK, RS = Tile<W>::RS;
    static constexpr bool kExtent = true;
    static_assert(BK == 4 * W && kBQ % RS == 0 && 4 % RS == 0 && 4 % Tile<W>::RP == 0,
                  "4 key vectors per block, whole tiles of at most 4 rows (item_impl clears 4)");
    static int64_t q_len(int64_t D) { return D; }
    static AlignedVec<float>& q_buf(Scratch& s) { return s.qb; }
    static void prepare(Scratch&) {}
    ATTN_INLINE static void pack(const Args& a, Scratch& s, int64_t b, int64_t hk, int64_t nkb,
                                 int64_t dvp) {
        pack_f32<W>(a, s, b, hk, nkb, dvp);
    }
    ATTN_INLINE static void load_q(const Args& a, int64_t qo, float* qb, int rr, int64_t D) {
        float* qd = qb + (rr / RS) * RS * D + rr % RS;
        if (a.dt == kAF32 && !a.round_bf16) {
            const float* src = static_cast<const float*>(a.q) + qo;
            for (int64_t d = 0; d < D; ++d) qd[d * RS] = src[d];
        } else {
            for (int64_t d = 0; d < D; ++d) qd[d * RS] = load_f32(a.q, qo + d, a.dt, a.round_bf16);
        }
    }
    // The tiles that hold the block's n query rows (short suffixes leave most of a block
    // empty), against the block's first nv key vectors.
    ATTN_INLINE static void scores(const Scratch& s, const float* qb, int64_t D, int64_t kb,
                                   float* sb, int n, int nv) {
        const float* kt = s.kt.data() + kb * D * BK;
        const int nr = (n + RS - 1) / RS * RS;
        for (int rr = 0; rr < nr; rr += RS) {
            const float* q = qb + rr * D;
            float* srow = sb + rr * BK;
            switch (nv) {
                case 1: qk_tile<W, RS, 1>(q, D, kt, srow); break;
                case 2: qk_tile<W, RS, 2>(q, D, kt, srow); break;
                case 3: qk_tile<W, RS, 3>(q, D, kt, srow); break;
                default: qk_tile<W, RS, 4>(q, D, kt, srow); break;
            }
        }
    }
    // Rows past n (no query) of the last tile get probability 0, so they add nothing; key
    // slots past nj are left out (probability 0 for every row).
    ATTN_INLINE static void pv(const Scratch& s, float* sb, int n, int64_t kb, int64_t dvp,
                               const float* alpha, float* ob, int nj) {
        constexpr int RP = Tile<W>::RP;
        const int nr = (n + RP - 1) / RP * RP;
        std::fill(sb + n * BK, sb + nr * BK, 0.f);
        pv_rows<W>(sb, s.vp.data() + kb * BK * dvp, dvp, alpha, ob, n, nj);
    }
};

void item_v2(const Args& a, int64_t b, int64_t hk, int64_t r0, int64_t r1) {
    item_impl<KF32<4>>(a, b, hk, r0, r1);
}

#ifdef ICQS_ATTN_X86
__attribute__((target("arch=x86-64-v3"))) void item_v3(const Args& a, int64_t b, int64_t hk,
                                                        int64_t r0, int64_t r1) {
    item_impl<KF32<8>>(a, b, hk, r0, r1);
}
__attribute__((target("arch=x86-64-v4"))) void item_v4(const Args& a, int64_t b, int64_t hk,
                                                        int64_t r0, int64_t r1) {
    item_impl<KF32<16>>(a, b, hk, r0, r1);
}
#endif

using ItemFn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t);

// ------------------------------------------------------------- bf16 kernel (AVX512_BF16)

#ifdef ICQS_ATTN_X86
#define ICQS_BF16_TARGET __attribute__((target("arch=x86-64-v4,avx512bf16")))

constexpr int kBK2 = 64;  // keys per block of the bf16 kernel (4 vectors of 16 scores)

ICQS_BF16_TARGET ATTN_INLINE __m512 dpbf16(__m512 acc, uint32_t pair, const uint32_t* b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)),
                            (__m512bh)_mm512_loadu_si512(b));
}

// fp32 -> bf16 bits of n elements, 16 a step: to_bf16's integer rounding (round to nearest
// even, NaN kept quiet; subnormals kept, unlike the conversion instruction), the same bits.
__attribute__((target("arch=x86-64-v4"))) void bf16_row_v4(const float* src, int64_t n,
                                                           uint16_t* dst) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm512_cvtepi32_epi16(bf16_rne16(_mm512_loadu_ps(src + i))));
    for (; i < n; ++i) dst[i] = to_bf16(src[i]);
}

// Keys as [block][D/2 pairs][64 keys] of (k[2p], k[2p+1]) and values as [block][32 key
// pairs][dvp] of (v[2t][c], v[2t+1][c]): the operand layouts of dpbf16 and of the AMX tiles
// (masked keys zero). A key's row is converted whole (bf16_row_v4; bf16 inputs as they are),
// so a pair is two consecutive bf16 of it; fp16 inputs go element by element.
ATTN_INLINE void pack_bf16(const Args& a, Scratch& s, int64_t b, int64_t hk, int64_t nkb,
                           int64_t d2, int64_t dvp) {
    pack_positions(a, s, b, kBK2, nkb);
    s.kt2.assign(static_cast<size_t>(nkb * d2 * kBK2), 0u);
    s.vp2.assign(static_cast<size_t>(nkb * (kBK2 / 2) * dvp), 0u);
    const int64_t kbase = b * a.ks[0] + hk * a.ks[1], vbase = b * a.vs[0] + hk * a.vs[1];
    const bool rows = a.dt != kAF16;
    s.row2.assign(static_cast<size_t>(2 * d2 + a.Dv), 0u);
    uint16_t* krow = s.row2.data();
    uint16_t* vrow = krow + 2 * d2;
    for (int64_t j = 0; j < a.Tk; ++j) {
        if (s.kp[j] < 0) continue;
        const int64_t kb = j / kBK2, jj = j % kBK2;
        const int64_t ko = kbase + j * a.ks[2], vo = vbase + j * a.vs[2];
        uint32_t* kt = s.kt2.data() + kb * d2 * kBK2 + jj;
        uint32_t* vp = s.vp2.data() + (kb * (kBK2 / 2) + jj / 2) * dvp;
        const int sh = static_cast<int>(jj % 2) * 16;
        if (rows) {
            if (a.dt == kAF32) {
                bf16_row_v4(static_cast<const float*>(a.k) + ko, a.D, krow);
                bf16_row_v4(static_cast<const float*>(a.v) + vo, a.Dv, vrow);
            } else {
                std::memcpy(krow, static_cast<const uint16_t*>(a.k) + ko, 2 * a.D);
                std::memcpy(vrow, static_cast<const uint16_t*>(a.v) + vo, 2 * a.Dv);
            }
            for (int64_t p = 0; p < d2; ++p) {
                uint32_t pair;
                std::memcpy(&pair, krow + 2 * p, sizeof(pair));  // krow[D] stays 0 for odd D
                kt[p * kBK2] = pair;
            }
            for (int64_t c = 0; c < a.Dv; ++c) vp[c] |= static_cast<uint32_t>(vrow[c]) << sh;
            continue;
        }
        for (int64_t p = 0; p < d2; ++p) {
            const uint32_t hi = 2 * p + 1 < a.D ? bf16_bits(a.k, ko + 2 * p + 1, a.dt) : 0u;
            kt[p * kBK2] = bf16_bits(a.k, ko + 2 * p, a.dt) | (hi << 16);
        }
        for (int64_t c = 0; c < a.Dv; ++c) vp[c] |= bf16_bits(a.v, vo + c, a.dt) << sh;
    }
}

template <int R>
ICQS_BF16_TARGET ATTN_INLINE void qk_tile_bf16(const uint32_t* q2, int64_t d2, const uint32_t* kt, float* srow) {
    __m512 acc[R][4];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < d2; ++p) {
        const uint32_t* kr = kt + p * kBK2;
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const uint32_t qp = q2[r * d2 + p];
            acc[r][0] = dpbf16(acc[r][0], qp, kr);
            acc[r][1] = dpbf16(acc[r][1], qp, kr + 16);
            acc[r][2] = dpbf16(acc[r][2], qp, kr + 32);
            acc[r][3] = dpbf16(acc[r][3], qp, kr + 48);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(srow + r * kBK2 + c * 16, acc[r][c]);
}

template <int R, int NC>
ICQS_BF16_TARGET ATTN_INLINE void pv_tile_bf16(const uint32_t* p2, const uint32_t* v2,
                                               int64_t dvp, const float* alpha, float* o) {
    __m512 acc[R][NC];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c)
            acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dvp + c * 16),
                                      _mm512_set1_ps(alpha[r]));
    for (int t = 0; t < kBK2 / 2; ++t) {
        const uint32_t* vr = v2 + t * dvp;
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const uint32_t pp = p2[r * (kBK2 / 2) + t];
            for (int c = 0; c < NC; ++c) acc[r][c] = dpbf16(acc[r][c], pp, vr + c * 16);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + r * dvp + c * 16, acc[r][c]);
}

// The bf16 kernel's parts for item_impl. Those with AVX512_BF16 intrinsics are out-of-line
// functions of that target (called once per key block, not inlined into the generic loop,
// which is inlined into item_bf16 and so compiled for the same target).
struct KBf16 {
    static constexpr int W = 16, BK = kBK2, R = 4;
    static constexpr bool kExtent = false;  // pv converts every slot's probability to bf16
    static_assert(4 % R == 0 && kBQ % R == 0, "tiles of at most 4 rows (item_impl clears 4)");
    static int64_t q_len(int64_t D) { return (D + 1) / 2; }
    static AlignedVec<uint32_t>& q_buf(Scratch& s) { return s.qb2; }
    static void prepare(Scratch& s) { s.pb2.resize(static_cast<size_t>(kBQ * kBK2 / 2)); }
    ATTN_INLINE static void pack(const Args& a, Scratch& s, int64_t b, int64_t hk, int64_t nkb,
                                 int64_t dvp) {
        pack_bf16(a, s, b, hk, nkb, q_len(a.D), dvp);
    }
    // A query row as bf16 pairs: (q[2p], q[2p+1]) little-endian is the row's bf16 in order, so
    // fp32 rows convert whole (bf16_row_v4, the same bits as to_bf16) and bf16 rows copy; in
    // the scalar loop they took about a third of a short-suffix call.
    ATTN_INLINE static void load_q(const Args& a, int64_t qo, uint32_t* qb, int rr,
                                   int64_t d2) {
        uint32_t* qd = qb + rr * d2;
        if (a.dt != kAF16) {
            uint16_t* q16 = reinterpret_cast<uint16_t*>(qd);
            if (a.dt == kAF32)
                bf16_row_v4(static_cast<const float*>(a.q) + qo, a.D, q16);
            else
                std::memcpy(q16, static_cast<const uint16_t*>(a.q) + qo, 2 * a.D);
            if (a.D % 2) q16[a.D] = 0;  // the last pair's missing half
            return;
        }
        for (int64_t p = 0; p < q_len(a.D); ++p) {
            const uint32_t hi = 2 * p + 1 < a.D ? bf16_bits(a.q, qo + 2 * p + 1, a.dt) : 0u;
            qd[p] = bf16_bits(a.q, qo + 2 * p, a.dt) | (hi << 16);
        }
    }
    ICQS_BF16_TARGET __attribute__((noinline)) static void scores(
        const Scratch& s, const uint32_t* qb, int64_t d2, int64_t kb, float* sb, int n, int) {
        const uint32_t* kt = s.kt2.data() + kb * d2 * kBK2;
        const int nr = (n + R - 1) / R * R;
        for (int rr = 0; rr < nr; rr += R) qk_tile_bf16<R>(qb + rr * d2, d2, kt, sb + rr * kBK2);
    }
    // Probabilities as bf16 in key order (consecutive pairs are dpbf16's pairs); rows past n
    // (no query) 0, so they add nothing.
    ICQS_BF16_TARGET __attribute__((noinline)) static void pv(
        Scratch& s, const float* sb, int n, int64_t kb, int64_t dvp, const float* alpha,
        float* ob, int) {
        uint32_t* pb = s.pb2.data();
        const int nr = (n + R - 1) / R * R;  // the tiles holding the block's query rows
        for (int rr = 0; rr < nr; ++rr) {
            uint32_t* prow = pb + rr * (kBK2 / 2);
            if (rr >= n) {
                std::fill(prow, prow + kBK2 / 2, 0u);
                continue;
            }
            for (int c = 0; c < kBK2; c += 16) {
                const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(sb + rr * kBK2 + c));
                std::memcpy(prow + c / 2, &h, sizeof(h));
            }
        }
        const uint32_t* vp = s.vp2.data() + kb * (kBK2 / 2) * dvp;
        const int64_t nv = dvp / 16;
        for (int rr = 0; rr < nr; rr += R) {
            const uint32_t* p2 = pb + rr * (kBK2 / 2);
            int64_t c = 0;
            for (; c + 4 <= nv; c += 4)
                pv_tile_bf16<R, 4>(p2, vp + c * 16, dvp, alpha + rr, ob + rr * dvp + c * 16);
            float* o = ob + rr * dvp + c * 16;
            switch (nv - c) {
                case 3: pv_tile_bf16<R, 3>(p2, vp + c * 16, dvp, alpha + rr, o); break;
                case 2: pv_tile_bf16<R, 2>(p2, vp + c * 16, dvp, alpha + rr, o); break;
                case 1: pv_tile_bf16<R, 1>(p2, vp + c * 16, dvp, alpha + rr, o); break;
                default: break;
            }
        }
    }
};

ICQS_BF16_TARGET void item_bf16(const Args& a, int64_t b, int64_t hk, int64_t r0, int64_t r1) {
    item_impl<KBf16>(a, b, hk, r0, r1);
}

// ------------------------------------------------------------------- bf16 kernel (AMX tiles)

#define ICQS_AMX_TARGET __attribute__((target("arch=x86-64-v4,avx512bf16,amx-tile,amx-bf16")))

// The bf16 kernel's layouts and softmax, with both products on AMX tiles (16 x 16 fp32 outputs,
// 32 bf16 products per element and step): keys [D/2 pairs][64 keys] are the B operand of
// S = Q K^T, values [32 key pairs][dvp] that of O += P V, as they are for dpbf16. Tiles 0-3
// accumulate, tile 4 holds 16 rows of the A operand (queries, or probabilities), 5-7 B. A
// score's or an output's sum is the tile unit's fixed order over its row and column, whatever
// the block's other rows. Needs D a multiple of 32 (whole A / B tiles).
struct KAmx : KBf16 {
    // The query rows' 16-row halves that hold queries (rows past n in a half are padding: their
    // scores are never read, their probabilities 0).
    ICQS_AMX_TARGET __attribute__((noinline)) static void scores(
        const Scratch& s, const uint32_t* qb, int64_t d2, int64_t kb, float* sb, int n, int) {
        const uint32_t* kt = s.kt2.data() + kb * d2 * kBK2;
        for (int h = 0; h * 16 < n; ++h) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t p0 = 0; p0 < d2; p0 += 16) {
                _tile_loadd(4, qb + h * 16 * d2 + p0, d2 * 4);
                const uint32_t* kr = kt + p0 * kBK2;
                _tile_loadd(5, kr, kBK2 * 4);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, kr + 16, kBK2 * 4);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(7, kr + 32, kBK2 * 4);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, kr + 48, kBK2 * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
            float* out = sb + h * 16 * kBK2;
            _tile_stored(0, out, kBK2 * 4);
            _tile_stored(1, out + 16, kBK2 * 4);
            _tile_stored(2, out + 32, kBK2 * 4);
            _tile_stored(3, out + 48, kBK2 * 4);
        }
    }
    ICQS_AMX_TARGET __attribute__((noinline)) static void pv(
        Scratch& s, const float* sb, int n, int64_t kb, int64_t dvp, const float* alpha,
        float* ob, int) {
        uint32_t* pb = s.pb2.data();
        const int nr = (n + 15) / 16 * 16;  // the halves holding the block's query rows
        for (int rr = 0; rr < nr; ++rr) {
            uint32_t* prow = pb + rr * (kBK2 / 2);
            float* orow = ob + rr * dvp;
            if (rr >= n) {  // padding: probability 0 (its output row is never read)
                std::fill(prow, prow + kBK2 / 2, 0u);
                continue;
            }
            for (int c = 0; c < kBK2; c += 16) {
                const __m256bh hb = _mm512_cvtneps_pbh(_mm512_loadu_ps(sb + rr * kBK2 + c));
                std::memcpy(prow + c / 2, &hb, sizeof(hb));
            }
            const __m512 al = _mm512_set1_ps(alpha[rr]);
            for (int64_t c = 0; c < dvp; c += 16)
                _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(orow + c), al));
        }
        const uint32_t* vp = s.vp2.data() + kb * (kBK2 / 2) * dvp;
        const int64_t nv = dvp / 16;
        for (int h = 0; h * 16 < n; ++h) {
            const uint32_t* p2 = pb + h * 16 * (kBK2 / 2);
            float* o = ob + h * 16 * dvp;
            for (int64_t c0 = 0; c0 < nv; c0 += 4) {
                const int nc = static_cast<int>(std::min<int64_t>(4, nv - c0));
                // Up to 4 column tiles of the output accumulate over the block's 64 keys
                // (2 steps of 32); tile 4 holds 16 rows x 32 keys of probabilities.
                if (nc > 0) _tile_loadd(0, o + c0 * 16, dvp * 4);
                if (nc > 1) _tile_loadd(1, o + (c0 + 1) * 16, dvp * 4);
                if (nc > 2) _tile_loadd(2, o + (c0 + 2) * 16, dvp * 4);
                if (nc > 3) _tile_loadd(3, o + (c0 + 3) * 16, dvp * 4);
                for (int t0 = 0; t0 < kBK2 / 2; t0 += 16) {
                    _tile_loadd(4, p2 + t0, (kBK2 / 2) * 4);
                    const uint32_t* vr = vp + t0 * dvp + c0 * 16;
                    _tile_loadd(5, vr, dvp * 4);
                    _tile_dpbf16ps(0, 4, 5);
                    if (nc > 1) {
                        _tile_loadd(6, vr + 16, dvp * 4);
                        _tile_dpbf16ps(1, 4, 6);
                    }
                    if (nc > 2) {
                        _tile_loadd(7, vr + 32, dvp * 4);
                        _tile_dpbf16ps(2, 4, 7);
                    }
                    if (nc > 3) {
                        _tile_loadd(5, vr + 48, dvp * 4);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                if (nc > 0) _tile_stored(0, o + c0 * 16, dvp * 4);
                if (nc > 1) _tile_stored(1, o + (c0 + 1) * 16, dvp * 4);
                if (nc > 2) _tile_stored(2, o + (c0 + 2) * 16, dvp * 4);
                if (nc > 3) _tile_stored(3, o + (c0 + 3) * 16, dvp * 4);
            }
        }
    }
};

// The tiles are configured once per thread and call (amx_begin / amx_end around the items),
// not per item: a short suffix's call runs hundreds of items of a few thousand scores each.
ICQS_AMX_TARGET void item_amx(const Args& a, int64_t b, int64_t hk, int64_t r0, int64_t r1) {
    item_impl<KAmx>(a, b, hk, r0, r1);
}
ICQS_AMX_TARGET void amx_begin() { amx_config_16x64(); }
ICQS_AMX_TARGET void amx_end() { _tile_release(); }

bool has_bf16_dot() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
}
#endif

std::atomic<uint64_t> g_call{0};

void attention_lse(uintptr_t q, py::tuple q_strides, uintptr_t k, py::tuple k_strides,
                   uintptr_t v, py::tuple v_strides, uintptr_t out, uintptr_t lse,
                   uintptr_t qpos, uintptr_t kpos, int64_t B, int64_t Hq, int64_t Hk,
                   int64_t Tq, int64_t Tk, int64_t D, int64_t Dv, int dtype, bool causal,
                   int64_t window, int64_t chunk, double scale, double softcap, int nthreads,
                   int isa, bool bf16_dot, bool round_bf16, uintptr_t state_in,
                   uintptr_t state_out, bool token_major, uintptr_t key_batch, int64_t Bk,
                   bool out_bf16) {
    if (B < 0 || Hq < 1 || Hk < 1 || Tq < 0 || Tk < 0 || D < 1 || Dv < 1)
        throw std::invalid_argument("attention_lse: sizes must be B, Tq, Tk >= 0 and H, D >= 1");
    if (Hq % Hk) throw std::invalid_argument("attention_lse: Hq must be a multiple of Hk");
    if (Tk >= INT32_MAX / 2) throw std::invalid_argument("attention_lse: Tk must be < 2^30");
    if (dtype != kAF32 && dtype != kAF16 && dtype != kABF16)
        throw std::invalid_argument("attention_lse: dtype code must be 0, 1 or 2");
    if (window < 0 || chunk < 0) throw std::invalid_argument("attention_lse: window, chunk >= 0");
    if (!std::isfinite(scale) || !std::isfinite(softcap) || softcap < 0)
        throw std::invalid_argument("attention_lse: scale finite, softcap finite and >= 0");
    if (q_strides.size() != 3 || k_strides.size() != 3 || v_strides.size() != 3)
        throw std::invalid_argument("attention_lse: strides are 3-tuples (dims 0..2)");
    const int best = cpu_isa_level();
    [[maybe_unused]] const bool auto_isa = isa < 0;  // AMX only at the CPU's own level
    if (isa < 0) isa = best;
    if (isa > best)
        throw std::invalid_argument("attention_lse: isa " + std::to_string(isa) +
                                    " is not supported by this CPU (best: " +
                                    std::to_string(best) + ")");
    Args a{};
    a.q = reinterpret_cast<const void*>(q);
    a.k = reinterpret_cast<const void*>(k);
    a.v = reinterpret_cast<const void*>(v);
    for (int i = 0; i < 3; ++i) {
        a.qs[i] = q_strides[i].cast<int64_t>();
        a.ks[i] = k_strides[i].cast<int64_t>();
        a.vs[i] = v_strides[i].cast<int64_t>();
    }
    a.out = reinterpret_cast<float*>(out);
    a.lse = reinterpret_cast<float*>(lse);
    a.qpos = reinterpret_cast<const int64_t*>(qpos);
    a.kpos = reinterpret_cast<const int64_t*>(kpos);
    a.B = B, a.Hq = Hq, a.Hk = Hk, a.Tq = Tq, a.Tk = Tk, a.D = D, a.Dv = Dv;
    a.dt = dtype;
    a.causal = causal;
    a.window = window;
    a.chunk = chunk;
    a.scale = static_cast<float>(scale);
    a.softcap = static_cast<float>(softcap);
    a.scale_log2 = static_cast<float>(scale * kLog2e);
    a.softcap_log2 = static_cast<float>(softcap * kLog2e);
    a.round_bf16 = round_bf16;
    a.state_in = reinterpret_cast<const float*>(state_in);
    a.state_out = reinterpret_cast<float*>(state_out);
    a.token_major = token_major;
    a.out_bf16 = out_bf16;
    a.kbatch = reinterpret_cast<const int64_t*>(key_batch);
    if (a.kbatch != nullptr)
        for (int64_t b = 0; b < B; ++b)
            if (a.kbatch[b] < 0 || a.kbatch[b] >= Bk)
                throw std::invalid_argument("attention_lse: key_batch values must be in [0, Bk)");
    a.call = ++g_call;
    if (B == 0 || Tq == 0) return;
    ItemFn fn = item_v2;
#ifdef ICQS_ATTN_X86
    bf16_dot = bf16_dot && has_bf16_dot();
    if (isa == 2) {
        fn = (dtype == kABF16 || round_bf16) && bf16_dot ? item_bf16 : item_v4;
        // AMX tiles only at the CPU's own best level (an explicit avx512 keeps to dpbf16, as
        // the linear kernel does) and for whole tiles of head dimensions.
        if (fn == item_bf16 && auto_isa && D % 32 == 0 && cpu_has_amx()) fn = item_amx;
    } else if (isa == 1) {
        fn = item_v3;
    }
#endif
    if (nthreads < 1) nthreads = 1;
    // Items: (b, hk, a range of the group * Tq rows); enough of them for a balanced dynamic
    // schedule, each at least one query block; consecutive items share a key head, so a thread
    // usually reuses its packed keys.
    const int64_t rows = (Hq / Hk) * Tq, heads = B * Hk;
    const int64_t want = std::max<int64_t>(1, (4 * int64_t(nthreads) + heads - 1) / heads);
    int64_t per = (rows + want - 1) / want;
    per = std::max<int64_t>(kBQ, (per + kBQ - 1) / kBQ * kBQ);
    const int64_t nper = (rows + per - 1) / per, nitems = heads * nper;
    // (b, hk) in item order: per run of query batches that share a key batch, key head by key
    // head; with key_batch, each such (key batch, key head) group's items go to one thread in
    // a row, which packs its keys once (when there are groups enough to share out).
    std::vector<std::pair<int64_t, int64_t>> order;
    std::vector<int64_t> group_at{0};  // where each group's items start (in order's units)
    order.reserve(static_cast<size_t>(heads));
    for (int64_t b0 = 0, b1; b0 < B; b0 = b1) {
        const int64_t kb0 = a.kbatch ? a.kbatch[b0] : b0;
        for (b1 = b0 + 1; b1 < B && a.kbatch && a.kbatch[b1] == kb0;) ++b1;
        for (int64_t hk = 0; hk < Hk; ++hk) {
            for (int64_t b = b0; b < b1; ++b) order.emplace_back(b, hk);
            group_at.push_back(static_cast<int64_t>(order.size()));
        }
    }
    const int64_t ngroups = static_cast<int64_t>(group_at.size()) - 1;
    const bool grouped = a.kbatch != nullptr && ngroups >= 4 * int64_t(nthreads);
#ifdef ICQS_ATTN_X86
    const bool tiles = fn == item_amx;
#endif
    py::gil_scoped_release nogil;
#pragma omp parallel num_threads(nthreads) if (nitems > 1 && nthreads > 1)
    {
#ifdef ICQS_ATTN_X86
        if (tiles) amx_begin();
#endif
        const int64_t nloop = grouped ? ngroups : nitems;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nloop; ++it) {
            const int64_t i0 = grouped ? group_at[it] * nper : it;
            const int64_t i1 = grouped ? group_at[it + 1] * nper : it + 1;
            for (int64_t i = i0; i < i1; ++i) {
                const int64_t r0 = (i % nper) * per, r1 = std::min(rows, r0 + per);
                const auto& [b, hk] = order[static_cast<size_t>(i / nper)];
                fn(a, b, hk, r0, r1);
            }
        }
#ifdef ICQS_ATTN_X86
        if (tiles) amx_end();
#endif
    }
}

}  // namespace

void register_attention(py::module_& m) {
    m.def("attention_lse", &attention_lse, py::arg("q"), py::arg("q_strides"), py::arg("k"),
          py::arg("k_strides"), py::arg("v"), py::arg("v_strides"), py::arg("out"),
          py::arg("lse"), py::arg("qpos"), py::arg("kpos"), py::arg("B"), py::arg("Hq"),
          py::arg("Hk"), py::arg("Tq"), py::arg("Tk"), py::arg("D"), py::arg("Dv"),
          py::arg("dtype"), py::arg("causal"), py::arg("window"), py::arg("chunk"),
          py::arg("scale"), py::arg("softcap"), py::arg("nthreads"), py::arg("isa") = -1,
          py::arg("bf16_dot") = true, py::arg("round_bf16") = false, py::arg("state_in") = 0,
          py::arg("state_out") = 0, py::arg("token_major") = false, py::arg("key_batch") = 0,
          py::arg("Bk") = 0, py::arg("out_bf16") = false,
          "Softmax attention with log-sum-exp: q [B,Hq,Tq,D], k [B,Hk,Tk,D], v [B,Hk,Tk,Dv] "
          "(raw pointers, element strides of dims 0..2, unit last-dim stride; dtype 0=fp32, "
          "1=fp16, 2=bf16) into out [B,Hq,Tq,Dv] fp32 ([B,Tq,Hq,Dv] with token_major) and "
          "lse [B,Hq,Tq] fp32 (contiguous; 0: not computed). "
          "qpos [B,Tq] / kpos [B,Tk] int64 positions (0 = defaults Tk-Tq+i / j; negative key "
          "position = masked key); causal, window, chunk (0 = none) on positions; softcap 0 = "
          "none. isa: -1 best, 0/1/2 as best_isa(). bf16_dot: bf16 inputs at isa 2 use the "
          "AVX512_BF16 dot products where the CPU has them (False: widen to fp32). round_bf16: "
          "q, k, v (any dtype) rounded to bf16 for the two products, fp32 accumulation (the "
          "bf16 dot products where bf16 inputs take them, else widened back to fp32). state_in / "
          "state_out (0 = none): [B,Hq,Tq,17+Dv] fp32 running softmax state (max in log2 "
          "units, 16 sum lanes, unnormalised output) to resume from / to write instead of out "
          "and lse. key_batch (0 = none): [B] int64, query batch b reads key batch "
          "key_batch[b] of k, v and kpos ([Bk, ...]): rows that share keys, without copies. "
          "out_bf16: out holds bf16, each fp32 output rounded to nearest even.");
    m.attr("attention_state_lanes") = kStateLanes;
    m.attr("attention_key_block") = 64;
    m.def("attention_bf16_dot", []() {
#ifdef ICQS_ATTN_X86
        return has_bf16_dot();
#else
        return false;
#endif
    }, "whether attention_lse runs bf16 inputs on AVX512_BF16 dot products here");
}

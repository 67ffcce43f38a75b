// The AVX-512 VNNI path (Ice Lake, Sapphire Rapids, Zen 4 and later): one zmm lane per output,
// 16 outputs a tile; each weight vector is unpacked once and used for every row of a row group
// (4-way u8 x s8 dot products, vpdpbusd), so rows cost little beyond the first. The float
// operations per lane are exactly the scalar reference's (kernels.h).
#if defined(__x86_64__)
#if defined(FORERUN_EMULATED)
#include "emulated_avx512.h"   // the path's tests on a CPU without AVX-512 (build.py)
#else
#include <immintrin.h>
#endif
#include <string.h>

#include <vector>

#include <math.h>
#include <omp.h>

#include "fr_math.h"
#include "kernels.h"

namespace forerun {

namespace {

constexpr int ROWS = 8;   // rows per group: each group reuses the tile's unpacked weights

inline __m512i load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline __m512 f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
// acc + the dot products of w with the 4 bytes (dot) or 2 int16 (dot16) at p in every lane: one
// instruction whose memory operand is broadcast ({1to16}). GCC does not fold _mm512_set1_epi32 of a
// load into these, and the separate vpbroadcastd measured 4 % slower over eight rows (Zen 4).
using i32_alias = int32_t __attribute__((may_alias));
inline __m512i dot(__m512i acc, __m512i w, const int8_t* x) {
#if defined(FORERUN_EMULATED)
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(*(const i32_alias*)x));   // the same sums
#else
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const i32_alias*)x));
    return acc;
#endif
}
inline __m512i dot16(__m512i acc, __m512i w, const int16_t* p) {
#if defined(FORERUN_EMULATED)
    return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(*(const i32_alias*)p));
#else
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const i32_alias*)p));
    return acc;
#endif
}

// init + the dots of k-groups [g0, g0 + count) against x (4 bytes a group), summed over A
// independent accumulators: a dot's latency is several cycles, and one chain through a single
// accumulator would leave the unit idle when few rows share the weights. Integer sums: any order.
template <int A>
inline __m512i dots(const __m512i* w, const int8_t* x, int g0, int count, __m512i init) {
    static_assert(A == 1 || A == 2 || A == 4, "1, 2 or 4 accumulators");
    __m512i p[A];
    p[0] = init;
    #pragma GCC unroll 8
    for (int i = 1; i < A; ++i) p[i] = _mm512_setzero_si512();
    #pragma GCC unroll 8
    for (int g = g0; g < g0 + count; ++g) p[(g - g0) % A] = dot(p[(g - g0) % A], w[g], x + 4 * (g - g0));
    if constexpr (A == 4) return _mm512_add_epi32(_mm512_add_epi32(p[0], p[1]), _mm512_add_epi32(p[2], p[3]));
    else if constexpr (A == 2) return _mm512_add_epi32(p[0], p[1]);
    else return p[0];
}

// Each lane's low 16 bits of `lo` and of `hi` as the int16 pair (lo, hi): one masked byte shuffle
// that puts bytes 0, 1 of `hi`'s lane in bytes 2, 3 and keeps `lo`'s bytes 0, 1.
inline __m512i pack16(__m512i lo, __m512i hi) {
    const __m512i from = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 1, 0, 0, 4, 5, 0, 0, 8, 9, 0, 0, 12, 13));
    return _mm512_mask_shuffle_epi8(lo, (__mmask64)0xCCCCCCCCCCCCCCCCULL, hi, from);
}

// Independent accumulators per row: more where fewer rows share the unpacked weights.
template <int R> constexpr int chains() { return R == 1 ? 4 : 2; }   // even: a unit's halves take half each

// The 8 k-group vectors of a 32-input unit: low nibbles are groups 0-3, high nibbles 4-7.
inline void nibbles(const uint8_t* qs, __m512i* w) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    #pragma GCC unroll 8
    for (int v = 0; v < 4; ++v) {
        const __m512i p = load(qs + 64 * v);
        w[v] = _mm512_and_si512(p, low);
        w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
    }
}

// The fifth bit from the unit's plane: group g's bit g of each byte moved to bit 4 (16-bit shifts:
// no bit crosses into a byte's bit 4) and or-ed in (0xF8: a | (b & c)).
inline void add_bit4(const uint8_t* qh, __m512i* w) {
    const __m512i s = _mm512_set1_epi8(16), p = load(qh);
    w[0] = _mm512_ternarylogic_epi32(w[0], _mm512_slli_epi16(p, 4), s, 0xF8);
    w[1] = _mm512_ternarylogic_epi32(w[1], _mm512_slli_epi16(p, 3), s, 0xF8);
    w[2] = _mm512_ternarylogic_epi32(w[2], _mm512_slli_epi16(p, 2), s, 0xF8);
    w[3] = _mm512_ternarylogic_epi32(w[3], _mm512_slli_epi16(p, 1), s, 0xF8);
    w[4] = _mm512_ternarylogic_epi32(w[4], p, s, 0xF8);
    w[5] = _mm512_ternarylogic_epi32(w[5], _mm512_srli_epi16(p, 1), s, 0xF8);
    w[6] = _mm512_ternarylogic_epi32(w[6], _mm512_srli_epi16(p, 2), s, 0xF8);
    w[7] = _mm512_ternarylogic_epi32(w[7], _mm512_srli_epi16(p, 3), s, 0xF8);
}

// Bytes ahead of the chunk being computed that are requested from memory: one core's stream is
// otherwise limited by how far the hardware prefetcher runs ahead of the arithmetic.
#ifndef FORERUN_PREFETCH
#define FORERUN_PREFETCH 16384
#endif
// Part `part` of `parts` of a chunk's requests, spread over the chunk's work: a burst of them at
// the chunk's start stalls the loads behind it.
inline void prefetch_lines(const uint8_t* c, int bytes, int part, int parts) {
    const int lines = (bytes + 63) / 64;
    for (int i = lines * part / parts; i < lines * (part + 1) / parts; ++i)
        _mm_prefetch((const char*)c + FORERUN_PREFETCH + 64 * i, _MM_HINT_T1);
}
template <int BYTES, int PARTS>
inline void prefetch_part(const uint8_t* c, int part) { prefetch_lines(c, BYTES, part, PARTS); }

struct Out {
    float* y[ROWS];
    const float* bias;
    __mmask16 valid;
};

inline void store(const Out& o, int r, __m512 acc) {
    if (o.bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(o.valid, o.bias));
    _mm512_mask_storeu_ps(o.y[r], o.valid, acc);
}

// --- one block at a time ------------------------------------------------------------------
// Each format's block is a run of units (K-quants: 8 units of 32 inputs; legacy: one unit of 32):
// `unit_*` unpacks a unit's 8 k-group vectors and its scale vectors from the chunk, `block_*` runs
// one block for R rows, its units unpacked on the spot (FROM = nullptr) or read from a buffer that
// `unpack_block` filled once for every row group of a tile (many rows, `tile_rows`).
constexpr int UNIT = 10;   // vectors a unit keeps in the buffer: 8 k-groups and up to 2 scale vectors
#define FR_INLINE inline __attribute__((always_inline))

template <int N>
FR_INLINE void from_buffer(const __m512i* from, __m512i* w) {
    #pragma GCC unroll 10
    for (int g = 0; g < N; ++g) w[g] = from[g];
}

template <bool FIVE>
FR_INLINE void unit_q4k(const uint8_t* c, int j, __m512i* w) {
    nibbles(c + q4k::QS + 256 * j, w);
    if (FIVE) add_bit4(c + q4k::QH + 64 * j, w);
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + q4k::SC + 16 * j)));
    // Q4_K applies each lane's scale to an int16 pair with one vpdpwssd: the scale twice a lane.
    w[8] = FIVE ? sc : _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));
}

template <int R, bool FIVE>
FR_INLINE void block_q4k(const uint8_t* c, const __m512i* from, int64_t b, const ActRow* a, __m512* acc) {
    constexpr int CB = FIVE ? q5k::BYTES : q4k::BYTES;
    __m512i isum[R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
        __m512i w[UNIT];
        if (from) {
            from_buffer<9>(from + UNIT * j, w);
        } else {
            prefetch_part<CB, 8>(c, j);
            unit_q4k<FIVE>(c, j, w);
        }
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const int8_t* x = a[r].q + b * QK_K + 32 * j;
            if constexpr (FIVE) {
                const __m512i p = dots<chains<R>()>(w, x, 0, 8, _mm512_setzero_si512());
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(p, w[8]));
            } else {
                // 4-bit weights: the sums of groups 0-3 and of groups 4-7 each fit in 16 bits (4
                // groups x 4 x 15 x 127 = 30480), so they go side by side into one lane's int16 pair
                // and one vpdpwssd applies the scale to both and adds them: no 32-bit multiply.
                const __m512i first = dots<chains<R>() / 2>(w, x, 0, 4, _mm512_setzero_si512());
                const __m512i second = dots<chains<R>() / 2>(w, x + 16, 4, 4, _mm512_setzero_si512());
                isum[r] = _mm512_dpwssd_epi32(isum[r], pack16(first, second), w[8]);
            }
        }
    }
    __m512i mn[4];
    #pragma GCC unroll 8
    for (int i = 0; i < 4; ++i)
        mn[i] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(c + q4k::MN + 32 * i)));
    const __m512 d = f16x16(c + q4k::D), dmin = f16x16(c + q4k::DMIN);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        const int16_t* s = a[r].sum32h + 8 * b;
        __m512i ms = _mm512_setzero_si512();
        #pragma GCC unroll 8
        for (int i = 0; i < 4; ++i) ms = dot16(ms, mn[i], s + 2 * i);
        const __m512 dx = _mm512_set1_ps(a[r].d[b]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[r]), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(ms), acc[r]);
    }
}

// Q6_K's 6-bit weights are stored as q + 32 (0..63). A pair of k-groups' dot products started from
// off8 (-32 times the pair's 8 inputs' sum) is the pair's sum of (q - 32) * x, at most 8 x 32 x 127
// = 32512 in magnitude: an int16. Two pairs go side by side into one lane's int16 pair and one
// vpdpwssd applies their sub-block's scale to both: no 32-bit multiply, no offset pass afterwards.
FR_INLINE void unit_q6k(const uint8_t* c, int u, __m512i* w) {
    const __m512i top = _mm512_set1_epi8(0x30);
    // Word indices that give each lane its own scale twice: sub-block 2u (words 0-15), 2u+1 (16-31).
    const __m512i first = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8,
                                           7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    nibbles(c + q6k::QL + 256 * u, w);
    #pragma GCC unroll 8
    for (int h = 0; h < 2; ++h) {
        const __m512i v = load(c + q6k::QH + 128 * u + 64 * h);
        w[4 * h + 0] = _mm512_or_si512(w[4 * h + 0], _mm512_and_si512(_mm512_slli_epi16(v, 4), top));
        w[4 * h + 1] = _mm512_or_si512(w[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(v, 2), top));
        w[4 * h + 2] = _mm512_or_si512(w[4 * h + 2], _mm512_and_si512(v, top));
        w[4 * h + 3] = _mm512_or_si512(w[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(v, 2), top));
    }
    const __m512i sc = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(c + q6k::SC + 32 * u)));
    w[8] = _mm512_permutexvar_epi16(first, sc);
    w[9] = _mm512_permutexvar_epi16(_mm512_add_epi16(first, _mm512_set1_epi16(16)), sc);
}

template <int R>
FR_INLINE void block_q6k(const uint8_t* c, const __m512i* from, int64_t b, const ActRow* a, __m512* acc) {
    __m512i isum[R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int u = 0; u < 8; ++u) {
        __m512i w[UNIT];
        if (from) {
            from_buffer<UNIT>(from + UNIT * u, w);
        } else {
            prefetch_part<q6k::BYTES, 8>(c, u);
            unit_q6k(c, u, w);
        }
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const int8_t* x = a[r].q + b * QK_K + 32 * u;
            const int32_t* off = a[r].off8 + 32 * b + 4 * u;
            __m512i pair[4];
            #pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) pair[i] = dots<1>(w, x + 8 * i, 2 * i, 2, _mm512_set1_epi32(off[i]));
            isum[r] = _mm512_dpwssd_epi32(isum[r], pack16(pair[0], pair[1]), w[8]);
            isum[r] = _mm512_dpwssd_epi32(isum[r], pack16(pair[2], pair[3]), w[9]);
        }
    }
    const __m512 d = f16x16(c + q6k::D);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a[r].d[b])), _mm512_cvtepi32_ps(isum[r]), acc[r]);
}

template <int TYPE>
struct Legacy {
    static constexpr bool HAS_M = TYPE == Q4_1 || TYPE == Q5_1, FIVE = TYPE == Q5_0 || TYPE == Q5_1;
    static constexpr int CB = TYPE == Q8_0 ? q8_0::BYTES : TYPE == Q4_0 ? q4_0::BYTES : TYPE == Q5_0 ? q5_0::BYTES
                            : TYPE == Q4_1 ? q4_1::BYTES : q5_1::BYTES;
    static constexpr int QS = HAS_M ? q4_1::QS : q4_0::QS, QH = HAS_M ? q4_1::QH : q4_0::QH;
    static constexpr int OFFSET = TYPE == Q8_0 ? -128 : TYPE == Q4_0 ? -8 : TYPE == Q5_0 ? -16 : 0;
};

template <int TYPE>
FR_INLINE void unit_legacy(const uint8_t* c, __m512i* w) {
    if (TYPE == Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);   // q + 128 as u8; the offset removes it
        #pragma GCC unroll 8
        for (int g = 0; g < 8; ++g) w[g] = _mm512_xor_si512(load(c + q8_0::Q + 64 * g), flip);
    } else {
        nibbles(c + Legacy<TYPE>::QS, w);
        if (Legacy<TYPE>::FIVE) add_bit4(c + Legacy<TYPE>::QH, w);
    }
}

template <int R, int TYPE>
FR_INLINE void block_legacy(const uint8_t* c, const __m512i* from, int64_t b, const ActRow* a, __m512* acc) {
    using L = Legacy<TYPE>;
    __m512i w[8];
    if (from) {
        from_buffer<8>(from, w);
    } else {
        prefetch_part<L::CB, 1>(c, 0);
        unit_legacy<TYPE>(c, w);
    }
    const __m512 d = f16x16(c);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        const int8_t* x = a[r].q + b * QK_0;
        const __m512i p = dots<chains<R>()>(w, x, 0, 8, _mm512_set1_epi32(L::OFFSET * a[r].sum32[b]));
        const __m512 dx = _mm512_set1_ps(a[r].d[b]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(p), acc[r]);
        if (L::HAS_M)
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(f16x16(c + q4_1::M), dx), _mm512_set1_ps((float)a[r].sum32[b]),
                                     acc[r]);
    }
}

template <int TYPE>
constexpr int chunk_of() {
    return TYPE == Q4_K ? q4k::BYTES : TYPE == Q5_K ? q5k::BYTES : TYPE == Q6_K ? q6k::BYTES : Legacy<TYPE>::CB;
}

// One block of TYPE for R rows (FROM: its units unpacked already, or nullptr).
template <int R, int TYPE>
FR_INLINE void block_any(const uint8_t* c, const __m512i* from, int64_t b, const ActRow* a, __m512* acc) {
    if constexpr (TYPE == Q4_K || TYPE == Q5_K) block_q4k<R, TYPE == Q5_K>(c, from, b, a, acc);
    else if constexpr (TYPE == Q6_K) block_q6k<R>(c, from, b, a, acc);
    else block_legacy<R, TYPE>(c, from, b, a, acc);
}

// A K-quant block's units unpacked into `buf` (UNIT vectors a unit).
template <int TYPE>
void unpack_block(const uint8_t* c, __m512i* buf) {
    for (int u = 0; u < 8; ++u) {
        if constexpr (TYPE == Q6_K) unit_q6k(c, u, buf + UNIT * u);
        else unit_q4k<TYPE == Q5_K>(c, u, buf + UNIT * u);
    }
}

// A tile for up to ROWS rows: every block unpacked on the spot, the accumulators in registers.
// Kept out of line: inlined into the dispatch's switch, one row's stream runs a third slower.
template <int R, int TYPE>
__attribute__((noinline)) void tile(const uint8_t* tile, int64_t blocks, const ActRow* a, const Out& o) {
    __m512 acc[R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) block_any<R, TYPE>(tile + b * chunk_of<TYPE>(), nullptr, b, a, acc);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) store(o, r, acc[r]);
}

template <int TYPE>
void group_block(int rows, const uint8_t* c, const __m512i* buf, int64_t b, const ActRow* a, __m512* acc) {
    switch (rows) {
        case 1: block_any<1, TYPE>(c, buf, b, a, acc); break;
        case 2: block_any<2, TYPE>(c, buf, b, a, acc); break;
        case 3: block_any<3, TYPE>(c, buf, b, a, acc); break;
        case 4: block_any<4, TYPE>(c, buf, b, a, acc); break;
        case 5: block_any<5, TYPE>(c, buf, b, a, acc); break;
        case 6: block_any<6, TYPE>(c, buf, b, a, acc); break;
        case 7: block_any<7, TYPE>(c, buf, b, a, acc); break;
        default: block_any<8, TYPE>(c, buf, b, a, acc); break;
    }
}

// Rows beyond one group, up to MANY: each block is unpacked once into a buffer that every group of
// ROWS rows reads (their accumulators kept in memory between blocks), instead of once a group.
constexpr int MANY = 64;

template <int TYPE>
__attribute__((noinline)) void tile_rows(const uint8_t* tile, int64_t blocks, const ActRow* a, int rows,
                                        const Out* outs) {
    alignas(64) __m512i buf[8 * UNIT];
    __m512 acc[MANY];
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* c = tile + b * chunk_of<TYPE>();
        unpack_block<TYPE>(c, buf);
        // The requests ahead spread over the groups' work, as the single group spreads them over units.
        const int groups = (rows + ROWS - 1) / ROWS;
        for (int g = 0; g < groups; ++g) {
            prefetch_lines(c, chunk_of<TYPE>(), g, groups);
            group_block<TYPE>(rows - g * ROWS < ROWS ? rows - g * ROWS : ROWS, c, buf, b, a + g * ROWS, acc + g * ROWS);
        }
    }
    for (int r = 0; r < rows; ++r) store(outs[r / ROWS], r % ROWS, acc[r]);
}

template <int TYPE>
void tile_group(int rows, const uint8_t* t, int64_t blocks, const ActRow* a, const Out* outs) {
    constexpr bool K_QUANT = TYPE == Q4_K || TYPE == Q5_K || TYPE == Q6_K;
    if (!K_QUANT && rows > ROWS) {   // a legacy block is one unit: little to share, the groups go alone
        for (int g = 0; g < rows; g += ROWS)
            tile_group<TYPE>(rows - g < ROWS ? rows - g : ROWS, t, blocks, a + g, outs + g / ROWS);
        return;
    }
    switch (rows) {
        case 1: tile<1, TYPE>(t, blocks, a, outs[0]); break;
        case 2: tile<2, TYPE>(t, blocks, a, outs[0]); break;
        case 3: tile<3, TYPE>(t, blocks, a, outs[0]); break;
        case 4: tile<4, TYPE>(t, blocks, a, outs[0]); break;
        case 5: tile<5, TYPE>(t, blocks, a, outs[0]); break;
        case 6: tile<6, TYPE>(t, blocks, a, outs[0]); break;
        case 7: tile<7, TYPE>(t, blocks, a, outs[0]); break;
        case 8: tile<8, TYPE>(t, blocks, a, outs[0]); break;
        default: if constexpr (K_QUANT) tile_rows<TYPE>(t, blocks, a, rows, outs); break;
    }
}

void tile_any(int type, int rows, const uint8_t* t, int64_t blocks, const ActRow* a, const Out* outs) {
    switch (type) {
        case Q4_K: tile_group<Q4_K>(rows, t, blocks, a, outs); break;
        case Q5_K: tile_group<Q5_K>(rows, t, blocks, a, outs); break;
        case Q6_K: tile_group<Q6_K>(rows, t, blocks, a, outs); break;
        case Q8_0: tile_group<Q8_0>(rows, t, blocks, a, outs); break;
        case Q4_0: tile_group<Q4_0>(rows, t, blocks, a, outs); break;
        case Q5_0: tile_group<Q5_0>(rows, t, blocks, a, outs); break;
        case Q4_1: tile_group<Q4_1>(rows, t, blocks, a, outs); break;
        case Q5_1: tile_group<Q5_1>(rows, t, blocks, a, outs); break;
        default: break;
    }
}

}  // namespace

void quantize_avx512(const float* x, int64_t m, int64_t k, int64_t ldx, int qb, uint8_t* act) {
    const size_t stride = act_row_bytes(k);
    for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * ldx;
        const ActRow a = act_row(act + r * stride, k, qb);
        int8_t* q = const_cast<int8_t*>(a.q);
        for (int64_t b = 0; b < k / qb; ++b) {
            const float* xb = xr + b * qb;
            __m512 mx = _mm512_setzero_ps();
            #pragma GCC unroll 8
            for (int i = 0; i < qb; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
            const float amax = _mm512_reduce_max_ps(mx);
            const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const_cast<float*>(a.d)[b] = amax / 127.0f;
            #pragma GCC unroll 8
            for (int i = 0; i < qb; i += 16) {
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), id));
                _mm_storeu_si128((__m128i*)(q + b * qb + i), _mm512_cvtsepi32_epi8(v));
            }
        }
        act_sums(q, k, act + r * stride);
    }
}

void matmul_avx512(int type, const uint8_t* w, int64_t k, const uint8_t* act, int64_t m, int64_t tile0,
                   int64_t tile1, int64_t n, float* y, int64_t ldy, const float* bias) {
    const int qb = block_inputs(type), cb = chunk_bytes(type);
    const int64_t blocks = k / qb;
    const size_t stride = act_row_bytes(k);
    std::vector<ActRow> a(m);   // every tile reads the same rows
    for (int64_t r = 0; r < m; ++r) a[r] = act_row(act + r * stride, k, qb);
    for (int64_t t = tile0; t < tile1; ++t) {
        const uint8_t* tile = w + (size_t)t * blocks * cb;
        const int64_t col = t * LANES;
        const int64_t valid = n - col < LANES ? n - col : LANES;
        for (int64_t r0 = 0; r0 < m; r0 += MANY) {
            const int rows = (int)(m - r0 < MANY ? m - r0 : MANY);
            Out outs[MANY / ROWS];
            for (int g = 0; g * ROWS < rows; ++g) {
                outs[g].bias = bias ? bias + col : nullptr;
                outs[g].valid = (__mmask16)((1u << valid) - 1);
            }
            for (int r = 0; r < rows; ++r) outs[r / ROWS].y[r % ROWS] = y + (r0 + r) * ldy + col;
            tile_any(type, rows, tile, blocks, a.data() + r0, outs);
        }
    }
}

namespace {
// exp_fr (fr_math.h), 16 lanes at a time: the same operations, so the same bits.
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[i]));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
// dot16_fr (fr_math.h) in one vector: lane l is acc[l]; the tree's halves are its halves.
inline float dot16(const float* a, const float* b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));    // t4[0] + t4[2], t4[1] + t4[3]
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}
// dot16 of q with 16 keys at once: 16 accumulators side by side (the fmas no longer wait on each
// other), then every key's tree16 together: each step adds the same pairs of lanes as dot16's
// halving, for two vectors at once, so every score has dot16's bits. The last step leaves key j
// at lane 4 (j % 4) + j / 4.
inline void dots16(const float* q, const float* const* k, int64_t n, float* out) {
    __m512 acc[16], w[8], x[4];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 qv = _mm512_loadu_ps(q + i);
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[j] + i), acc[j]);
    }
    for (int m = 0; m < 8; ++m)   // lanes l + (l + 8): two keys' halves a vector
        w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], 0xEE));
    for (int m = 0; m < 4; ++m)   // l + (l + 4): four keys' quarters
        x[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0xDD));
    const __m512 y0 = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x44), _mm512_shuffle_ps(x[0], x[1], 0xEE));
    const __m512 y1 = _mm512_add_ps(_mm512_shuffle_ps(x[2], x[3], 0x44), _mm512_shuffle_ps(x[2], x[3], 0xEE));
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y0, y1, 0x88), _mm512_shuffle_ps(y0, y1, 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, z));
}
void to_half(const float* x, uint16_t* h, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i*)(h + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}
void from_half(const uint16_t* h, float* x, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + i))));
}
void exp_shift(float* p, int64_t n, float sub) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(p + i, exp16(_mm512_sub_ps(_mm512_loadu_ps(p + i), _mm512_set1_ps(sub))));
    for (; i < n; ++i) p[i] = exp_fr(p[i] - sub);
}
void silu_mul(float* gate, const float* up, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_storeu_ps(gate + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                                 _mm512_loadu_ps(up + i)));
    }
    for (; i < n; ++i) gate[i] = silu_mul_fr(gate[i], up[i]);
}
// Eight 16-lane sums: 8 of the 32 zmm registers.
constexpr int WEIGH_HEADS = 4, WEIGH_SUMS = 8;
#define FR_QUANTIZE quantize_avx512
#define FR_MATMUL matmul_avx512
#include "layer_impl.h"
#undef FR_QUANTIZE
#undef FR_MATMUL
}  // namespace

void layer_avx512(const LayerDesc& l, const PassDesc& pass, int64_t layer, float* x, int id, int threads) {
    run_layer(l, pass, layer, x, id, threads);
}

void norm_head_avx512(const Product& head, const float* gain, float eps, const PassDesc& pass, const float* x,
                       int64_t ldx, float* h, float* y, int id, int threads) {
    run_norm_head(head, gain, eps, pass, x, ldx, h, y, id, threads);
}

void rmsnorm_avx512(const float* x, int64_t m, int64_t n, int64_t ldx, const float* gain, float eps, float* out) {
    for (int64_t r = 0; r < m; ++r) rmsnorm(x + r * ldx, gain, eps, n, out + r * n);
}

// Two passes: the largest value (any NaN sends the row to the scalar scan, which finds the first),
// then the first index holding it. A logits row is read once from cache by each.
int64_t argmax_avx512(const float* x, int64_t n) {
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
    __mmask16 unordered = 0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        m0 = _mm512_max_ps(m0, a);
        m1 = _mm512_max_ps(m1, b);
        unordered |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    }
    if (i < n) {
        const __mmask16 tail0 = (__mmask16)(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
        const __m512 a = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail0, x + i);
        m0 = _mm512_max_ps(m0, a);
        unordered |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        if (n - i > 16) {
            const __mmask16 tail1 = (__mmask16)((1u << (n - i - 16)) - 1);
            const __m512 b = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail1, x + i + 16);
            m1 = _mm512_max_ps(m1, b);
            unordered |= _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
        }
    }
    if (unordered) return argmax_scalar(x, n);
    const __m512 target = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(m0, m1)));
    for (i = 0; i < n; i += 16) {
        const __mmask16 in = (__mmask16)(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
        const __mmask16 hits = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, x + i), target, _CMP_EQ_OQ);
        if (hits) return i + __builtin_ctz(hits);
    }
    return 0;  // not reached: the largest value is one of x
}

float sum_exp_avx512(const float* x, int64_t n, float m) {
    const __m512 shift = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), shift)));
    float lanes[16];
    _mm512_storeu_ps(lanes, acc);
    for (; i < n; ++i) lanes[i % 16] += exp_fr(x[i] - m);  // exp16's bits, lane by lane
    return tree16(lanes);
}

}  // namespace forerun
#endif

// The AVX2 path (Zen 2/3, Haswell and later without AVX-512 VNNI): a tile's 16 outputs in two
// halves of 8 ymm lanes. u8 x s8 products are summed in pairs into int16 (vpmaddubsw) and, as far as
// no sum can pass 32767, several groups' pairs are added in int16 before one vpmaddwd turns them
// into int32 and applies the sub-block's scale in the same instruction. A tile runs up to eight rows
// (Q8_0: four) against each unpacked weight vector; the K-quants unpack half a unit's groups at a
// time (`quad`), so four weight vectors and eight rows' sums fit the sixteen ymm registers. Integer
// sums are exact in any order; the float operations per lane are exactly the scalar reference's
// (kernels.h).
#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#include <math.h>
#include <omp.h>

#include "fr_math.h"
#include "kernels.h"

namespace forerun {

namespace {

constexpr int ROWS = 8;
constexpr int HALF = 8;   // lanes a ymm holds

inline int32_t ld32(const void* p) { int32_t v; memcpy(&v, p, 4); return v; }
inline __m256i load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256i ones16() { return _mm256_set1_epi16(1); }

// Groups 4 * part .. 4 * part + 3 of half h of a 32-input unit (part 0: the low nibbles).
inline void quad(const uint8_t* qs, int h, int part, __m256i* w) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int v = 0; v < 4; ++v) {
        const __m256i p = load(qs + 64 * v + 32 * h);
        w[v] = _mm256_and_si256(part ? _mm256_srli_epi16(p, 4) : p, low);
    }
}

// The fifth bit of those groups' weights (Q5_K, Q5_0, Q5_1), from half h of the unit's plane:
// group g's bit g of each byte moved to bit 4 (16-bit shifts: no bit crosses into a byte's bit 4).
inline void add_bit4_quad(const uint8_t* qh, int h, int part, __m256i* w) {
    const __m256i sixteen = _mm256_set1_epi8(16), p = load(qh + 32 * h);
    __m256i at4[4];
    if (part == 0) {
        at4[0] = _mm256_slli_epi16(p, 4); at4[1] = _mm256_slli_epi16(p, 3);
        at4[2] = _mm256_slli_epi16(p, 2); at4[3] = _mm256_slli_epi16(p, 1);
    } else {
        at4[0] = p; at4[1] = _mm256_srli_epi16(p, 1);
        at4[2] = _mm256_srli_epi16(p, 2); at4[3] = _mm256_srli_epi16(p, 3);
    }
    for (int v = 0; v < 4; ++v) w[v] = _mm256_or_si256(w[v], _mm256_and_si256(at4[v], sixteen));
}

// Half h of a 32-input unit's 8 k-group vectors (and with `qh` their fifth bits): both quads.
inline void nibbles(const uint8_t* qs, int h, __m256i* w, const uint8_t* qh = nullptr) {
    for (int part = 0; part < 2; ++part) {
        quad(qs, h, part, w + 4 * part);
        if (qh) add_bit4_quad(qh, h, part, w + 4 * part);
    }
}

// Requests for the bytes ahead of the chunk being computed: into L2 far ahead, into L1 near (one
// core's stream is otherwise limited by how far the hardware prefetcher runs ahead). Part `part`
// of `parts` of them, spread over the chunk's work: a burst at the chunk's start stalls the loads
// behind it.
template <int BYTES, int PARTS>
inline void prefetch_part(const uint8_t* c, int part) {
    constexpr int LINES = (BYTES + 63) / 64;
    for (int i = LINES * part / PARTS; i < LINES * (part + 1) / PARTS; ++i) {
        _mm_prefetch((const char*)c + 16384 + 64 * i, _MM_HINT_T1);
        _mm_prefetch((const char*)c + 1024 + 64 * i, _MM_HINT_T0);
    }
}

struct Out {
    float* y[ROWS];
    const float* bias;
    int valid;   // outputs of this tile that exist (the last tile may be short)
};

inline void store(const Out& o, int r, int h, __m256 acc) {
    const int lanes = o.valid - HALF * h;
    if (lanes <= 0) return;
    alignas(32) float v[HALF];
    _mm256_store_ps(v, acc);
    float* y = o.y[r] + HALF * h;
    for (int i = 0; i < HALF && i < lanes; ++i) y[i] = o.bias ? v[i] + o.bias[HALF * h + i] : v[i];
}

// The u8 x s8 products of k-groups [g0, g0 + count) against x, each lane's pairs summed in int16
// (vpmaddubsw, then plain 16-bit adds): exact while count * (2 * top * 127) < 32768, which the
// callers keep (4-bit weights: 8 groups; 5-bit: 4; 6-bit: 2).
inline __m256i pairs(const __m256i* w, const int8_t* x, int g0, int count) {
    __m256i t = _mm256_maddubs_epi16(w[g0], _mm256_set1_epi32(ld32(x)));
    for (int g = 1; g < count; ++g)
        t = _mm256_add_epi16(t, _mm256_maddubs_epi16(w[g0 + g], _mm256_set1_epi32(ld32(x + 4 * g))));
    return t;
}

// Eight lanes' scales as the int16 pair (sc, sc) of each lane, for vpmaddwd.
inline __m256i scale_pairs(__m256i sc32) {
    return _mm256_or_si256(_mm256_and_si256(sc32, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc32, 16));
}

// The tile kernels are never inlined: inlined into the dispatcher below, GCC compiled the legacy
// formats' one to four rows into code 1.4-1.8x slower (Q4_0, Q4_1 and Q5_0; run 160), and which
// kernels it inlined changed with edits elsewhere in this file.
#define FR_TILE __attribute__((noinline))

// One or two rows of Q4_K take both halves of a tile in one pass over its blocks, so that their
// inputs are broadcast once for sixteen outputs (one row 0.80x the time here, run 158; two rows
// 0.93x, run 160; Q5_K so took twice its time, the code GCC made for it spilling); more rows take a
// half at a time (their sums fill the registers: three or four rows so were slower).
template <int R, bool FIVE>
FR_TILE void tile_q4k(const uint8_t* tile, int64_t blocks, const ActRow* a, const Out& o) {
    constexpr int CB = FIVE ? q5k::BYTES : q4k::BYTES, HS = R <= 2 && !FIVE ? 2 : 1;
    for (int h0 = 0; h0 < 2; h0 += HS) {
        __m256 acc[HS][R];
        for (int i = 0; i < HS * R; ++i) acc[i / R][i % R] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* c = tile + b * CB;
            __m256i isum[HS][R];
            for (int i = 0; i < HS * R; ++i) isum[i / R][i % R] = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                if (h0 == 0) prefetch_part<CB, 8>(c, j);
                // The low nibbles' four groups for every row, then the high nibbles': four weight
                // vectors live instead of eight, so the rows' sums stay in registers.
                __m256i sc[HS];
                for (int hh = 0; hh < HS; ++hh)
                    sc[hh] = scale_pairs(_mm256_cvtepu8_epi32(
                        _mm_loadl_epi64((const __m128i*)(c + q4k::SC + 16 * j + HALF * (h0 + hh)))));
                for (int part = 0; part < 2; ++part)
                    for (int hh = 0; hh < HS; ++hh) {
                        const int h = h0 + hh;
                        __m256i w[4];
                        quad(c + q4k::QS + 256 * j, h, part, w);
                        if (FIVE) add_bit4_quad(c + q4k::QH + 64 * j, h, part, w);
                        for (int r = 0; r < R; ++r) {
                            const int8_t* x = a[r].q + b * QK_K + 32 * j + 16 * part;
                            // Four groups' pairs in int16: 5-bit weights reach 4 * 2 * 31 * 127 < 32768.
                            isum[hh][r] = _mm256_add_epi32(isum[hh][r], _mm256_madd_epi16(pairs(w, x, 0, 4), sc[hh]));
                        }
                    }
            }
            for (int hh = 0; hh < HS; ++hh) {
                const int h = h0 + hh;
                __m256i mn[4];
                for (int i = 0; i < 4; ++i)
                    mn[i] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(c + q4k::MN + 32 * i + 16 * h)));
                const __m256 d = f16x8(c + q4k::D + 16 * h), dmin = f16x8(c + q4k::DMIN + 16 * h);
                for (int r = 0; r < R; ++r) {
                    const int16_t* s = a[r].sum32h + 8 * b;
                    __m256i ms = _mm256_setzero_si256();
                    for (int i = 0; i < 4; ++i)
                        ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mn[i], _mm256_set1_epi32(ld32(s + 2 * i))));
                    const __m256 dx = _mm256_set1_ps(a[r].d[b]);
                    acc[hh][r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum[hh][r]), acc[hh][r]);
                    acc[hh][r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(ms), acc[hh][r]);
                }
            }
        }
        for (int hh = 0; hh < HS; ++hh)
            for (int r = 0; r < R; ++r) store(o, r, h0 + hh, acc[hh][r]);
    }
}

template <int R>
FR_TILE void tile_q6k(const uint8_t* tile, int64_t blocks, const ActRow* a, const Out& o) {
    const __m256i top = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* c = tile + b * q6k::BYTES;
            __m256i isum[R];
            for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
            for (int u = 0; u < 8; ++u) {
                if (h == 0) prefetch_part<q6k::BYTES, 8>(c, u);
                // Groups 0-3 (the low nibbles, the first 16 inputs, scale sc0) for every row, then
                // groups 4-7 (the high nibbles, sc1): four weight vectors live instead of eight.
                for (int part = 0; part < 2; ++part) {
                    __m256i w[4];
                    quad(c + q6k::QL + 256 * u, h, part, w);
                    const __m256i bits = load(c + q6k::QH + 128 * u + 64 * part + 32 * h);
                    w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(bits, 4), top));
                    w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(bits, 2), top));
                    w[2] = _mm256_or_si256(w[2], _mm256_and_si256(bits, top));
                    w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_srli_epi16(bits, 2), top));
                    const __m256i sc = scale_pairs(_mm256_cvtepi8_epi32(
                        _mm_loadl_epi64((const __m128i*)(c + q6k::SC + 32 * u + 16 * part + HALF * h))));
                    for (int r = 0; r < R; ++r) {
                        const int8_t* x = a[r].q + b * QK_K + 32 * u + 16 * part;
                        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(pairs(w, x, 0, 2), sc),
                                                           _mm256_madd_epi16(pairs(w, x + 8, 2, 2), sc));
                        isum[r] = _mm256_add_epi32(isum[r], p);
                    }
                }
            }
            // The weights were stored as q + 32: take 32 * sum_j sc_j * (sum of x over sub-block j).
            __m256i scp[8];
            for (int i = 0; i < 8; ++i) {
                const __m128i lo = _mm_loadl_epi64((const __m128i*)(c + q6k::SC + 32 * i + HALF * h));
                const __m128i hi = _mm_loadl_epi64((const __m128i*)(c + q6k::SC + 32 * i + 16 + HALF * h));
                scp[i] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo, hi));   // lanes: (sc_2i, sc_2i+1)
            }
            const __m256 d = f16x8(c + q6k::D + 16 * h);
            for (int r = 0; r < R; ++r) {
                const int16_t* s = a[r].sum16h + 16 * b;
                __m256i offset = _mm256_setzero_si256();
                for (int i = 0; i < 8; ++i)
                    offset = _mm256_add_epi32(offset, _mm256_madd_epi16(scp[i], _mm256_set1_epi32(ld32(s + 2 * i))));
                const __m256i total = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(offset, 5));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[r].d[b])), _mm256_cvtepi32_ps(total), acc[r]);
            }
        }
        for (int r = 0; r < R; ++r) store(o, r, h, acc[r]);
    }
}

template <int R, int TYPE>
FR_TILE void tile_legacy(const uint8_t* tile, int64_t blocks, const ActRow* a, const Out& o) {
    constexpr bool HAS_M = TYPE == Q4_1 || TYPE == Q5_1, FIVE = TYPE == Q5_0 || TYPE == Q5_1;
    constexpr int CB = TYPE == Q8_0 ? q8_0::BYTES : TYPE == Q4_0 ? q4_0::BYTES : TYPE == Q5_0 ? q5_0::BYTES
                     : TYPE == Q4_1 ? q4_1::BYTES : q5_1::BYTES;
    constexpr int QS = HAS_M ? q4_1::QS : q4_0::QS, QH = HAS_M ? q4_1::QH : q4_0::QH;
    constexpr int OFFSET = TYPE == Q4_0 ? -8 : TYPE == Q5_0 ? -16 : 0;
    constexpr int RUN = TYPE == Q8_0 ? 1 : FIVE ? 4 : 8;
    const __m256i ones = ones16();
    for (int h = 0; h < 2; ++h) {
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* c = tile + b * CB;
            if (h == 0) prefetch_part<CB, 1>(c, 0);
            __m256i w[8], magnitude[8];
            if (TYPE == Q8_0) {
                for (int g = 0; g < 8; ++g) {
                    w[g] = load(c + q8_0::Q + 64 * g + 32 * h);
                    magnitude[g] = _mm256_abs_epi8(w[g]);
                }
            } else {
                nibbles(c + QS, h, w, FIVE ? c + QH : nullptr);
            }
            const __m256 d = f16x8(c + 16 * h);
            for (int r = 0; r < R; ++r) {
                const int8_t* x = a[r].q + b * QK_0;
                __m256i p = _mm256_set1_epi32(OFFSET * a[r].sum32[b]);
                if (TYPE == Q8_0) {
                    // |w| times x with w's sign: no pair can saturate (128 * 127 * 2), none can share an int16.
                    for (int g = 0; g < 8; ++g) {
                        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(ld32(x + 4 * g)), w[g]);
                        p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[g], xs), ones));
                    }
                } else {
                    for (int g = 0; g < 8; g += RUN)
                        p = _mm256_add_epi32(p, _mm256_madd_epi16(pairs(w, x + 4 * g, g, RUN), ones));
                }
                const __m256 dx = _mm256_set1_ps(a[r].d[b]);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(p), acc[r]);
                if (HAS_M)
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(f16x8(c + q4_1::M + 16 * h), dx),
                                             _mm256_set1_ps((float)a[r].sum32[b]), acc[r]);
            }
        }
        for (int r = 0; r < R; ++r) store(o, r, h, acc[r]);
    }
}

template <int R>
void tile_any(int type, const uint8_t* tile, int64_t blocks, const ActRow* a, const Out& o) {
    switch (type) {
        case Q4_K: tile_q4k<R, false>(tile, blocks, a, o); break;
        case Q5_K: tile_q4k<R, true>(tile, blocks, a, o); break;
        case Q6_K: tile_q6k<R>(tile, blocks, a, o); break;
        case Q8_0: tile_legacy<R, Q8_0>(tile, blocks, a, o); break;
        case Q4_0: tile_legacy<R, Q4_0>(tile, blocks, a, o); break;
        case Q5_0: tile_legacy<R, Q5_0>(tile, blocks, a, o); break;
        case Q4_1: tile_legacy<R, Q4_1>(tile, blocks, a, o); break;
        case Q5_1: tile_legacy<R, Q5_1>(tile, blocks, a, o); break;
        default: break;
    }
}

inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

}  // namespace

void quantize_avx2(const float* x, int64_t m, int64_t k, int64_t ldx, int qb, uint8_t* act) {
    const size_t stride = act_row_bytes(k);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * ldx;
        const ActRow a = act_row(act + r * stride, k, qb);
        int8_t* q = const_cast<int8_t*>(a.q);
        for (int64_t b = 0; b < k / qb; ++b) {
            const float* xb = xr + b * qb;
            __m256 mx = _mm256_setzero_ps();
            for (int i = 0; i < qb; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
            const float amax = hmax(mx);
            const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const_cast<float*>(a.d)[b] = amax / 127.0f;
            for (int i = 0; i < qb; i += 32) {
                __m256i v[4];
                for (int j = 0; j < 4; ++j) v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * j), id));
                const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
                _mm256_storeu_si256((__m256i*)(q + b * qb + i), _mm256_permutevar8x32_epi32(packed, order));
            }
        }
        act_sums(q, k, act + r * stride);
    }
}

void matmul_avx2(int type, const uint8_t* w, int64_t k, const uint8_t* act, int64_t m, int64_t tile0,
                 int64_t tile1, int64_t n, float* y, int64_t ldy, const float* bias) {
    const int qb = block_inputs(type), cb = chunk_bytes(type);
    const int64_t blocks = k / qb;
    const size_t stride = act_row_bytes(k);
    for (int64_t t = tile0; t < tile1; ++t) {
        const uint8_t* tile = w + (size_t)t * blocks * cb;
        const int64_t col = t * LANES;
        // Q8_0 keeps its weights and their magnitudes (sixteen vectors) beside the rows: four rows
        // at a time measure faster there than eight.
        const int64_t group = type == Q8_0 ? 4 : ROWS;
        for (int64_t r0 = 0; r0 < m; r0 += group) {
            const int rows = (int)(m - r0 < group ? m - r0 : group);
            ActRow a[ROWS];
            Out o;
            o.bias = bias ? bias + col : nullptr;
            o.valid = (int)(n - col < LANES ? n - col : LANES);
            for (int r = 0; r < rows; ++r) {
                a[r] = act_row(act + (r0 + r) * stride, k, qb);
                o.y[r] = y + (r0 + r) * ldy + col;
            }
            switch (rows) {
                case 1: tile_any<1>(type, tile, blocks, a, o); break;
                case 2: tile_any<2>(type, tile, blocks, a, o); break;
                case 3: tile_any<3>(type, tile, blocks, a, o); break;
                case 4: tile_any<4>(type, tile, blocks, a, o); break;
                case 5: tile_any<5>(type, tile, blocks, a, o); break;
                case 6: tile_any<6>(type, tile, blocks, a, o); break;
                case 7: tile_any<7>(type, tile, blocks, a, o); break;
                default: tile_any<8>(type, tile, blocks, a, o); break;
            }
        }
    }
}

namespace {
// exp_fr (fr_math.h), 8 lanes at a time: the same operations, so the same bits.
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
// dot16_fr (fr_math.h) in two vectors: lanes 0-7 and 8-15, so the tree's first step adds them.
inline float dot16(const float* a, const float* b, int64_t n) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
    }
    const __m256 t8 = _mm256_add_ps(lo, hi);
    const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));    // t4[0] + t4[2], t4[1] + t4[3]
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}
// dot16 of q with 4 keys at once (the fmas of different keys side by side), then the four keys'
// tree16 together, each step adding dot16's pairs of lanes: dot16's bits. 16 keys: four of these.
inline void dots4(const float* q, const float* const* k, int64_t n, float* out) {
    __m256 lo[4], hi[4], t[4];
    for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __m256 ql = _mm256_loadu_ps(q + i), qh = _mm256_loadu_ps(q + i + 8);
        for (int j = 0; j < 4; ++j) {
            lo[j] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k[j] + i), lo[j]);
            hi[j] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k[j] + i + 8), hi[j]);
        }
    }
    for (int j = 0; j < 4; ++j) t[j] = _mm256_add_ps(lo[j], hi[j]);   // lanes l + (l + 8)
    const __m256 x0 = _mm256_add_ps(_mm256_permute2f128_ps(t[0], t[1], 0x20), _mm256_permute2f128_ps(t[0], t[1], 0x31));
    const __m256 x1 = _mm256_add_ps(_mm256_permute2f128_ps(t[2], t[3], 0x20), _mm256_permute2f128_ps(t[2], t[3], 0x31));
    const __m256 y = _mm256_add_ps(_mm256_shuffle_ps(x0, x1, 0x44), _mm256_shuffle_ps(x0, x1, 0xEE));
    const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(y, y, 0x88), _mm256_shuffle_ps(y, y, 0xDD));
    _mm_storeu_ps(out, _mm_unpacklo_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1)));   // k0 k1 k2 k3
}
inline void dots16(const float* q, const float* const* k, int64_t n, float* out) {
    for (int j = 0; j < 16; j += 4) dots4(q, k + j, n, out + j);
}
void to_half(const float* x, uint16_t* h, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i*)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}
void from_half(const uint16_t* h, float* x, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
}
void exp_shift(float* p, int64_t n, float sub) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(p + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(sub))));
    for (; i < n; ++i) p[i] = exp_fr(p[i] - sub);
}
void silu_mul(float* gate, const float* up, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                                 _mm256_loadu_ps(up + i)));
    }
    for (; i < n; ++i) gate[i] = silu_mul_fr(gate[i], up[i]);
}
// Six heads' sums over 16 columns each: 12 of the 16 ymm registers, the rest for a value row and p.
constexpr int WEIGH_HEADS = 6, WEIGH_SUMS = 6;
#define FR_QUANTIZE quantize_avx2
#define FR_MATMUL matmul_avx2
#include "layer_impl.h"
#undef FR_QUANTIZE
#undef FR_MATMUL
}  // namespace

void layer_avx2(const LayerDesc& l, const PassDesc& pass, int64_t layer, float* x, int id, int threads) {
    run_layer(l, pass, layer, x, id, threads);
}

void norm_head_avx2(const Product& head, const float* gain, float eps, const PassDesc& pass, const float* x,
                       int64_t ldx, float* h, float* y, int id, int threads) {
    run_norm_head(head, gain, eps, pass, x, ldx, h, y, id, threads);
}

void rmsnorm_avx2(const float* x, int64_t m, int64_t n, int64_t ldx, const float* gain, float eps, float* out) {
    for (int64_t r = 0; r < m; ++r) rmsnorm(x + r * ldx, gain, eps, n, out + r * n);
}

// Two passes: the largest value (any NaN sends the row to the scalar scan, which finds the first),
// then the first index holding it. A logits row is read once from cache by each.
int64_t argmax_avx2(const float* x, int64_t n) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        m0 = _mm256_max_ps(m0, a);
        m1 = _mm256_max_ps(m1, b);
        unordered = _mm256_or_ps(unordered, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
    }
    if (_mm256_movemask_ps(unordered)) return argmax_scalar(x, n);
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    float best = lanes[0];
    for (int j = 1; j < 8; ++j) best = lanes[j] > best ? lanes[j] : best;
    for (int64_t j = i; j < n; ++j) {
        if (x[j] != x[j]) return argmax_scalar(x, n);
        best = x[j] > best ? x[j] : best;
    }
    const __m256 target = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
        if (hits) return i + __builtin_ctz(hits);
    }
    for (; i < n; ++i)
        if (x[i] == best) return i;
    return 0;  // not reached: best is one of x
}

float sum_exp_avx2(const float* x, int64_t n, float m) {
    const __m256 shift = _mm256_set1_ps(m);
    __m256 lo = _mm256_setzero_ps(), hi = lo;   // lanes 0-7 and 8-15
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        lo = _mm256_add_ps(lo, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift)));
        hi = _mm256_add_ps(hi, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), shift)));
    }
    float lanes[16];
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
    for (; i < n; ++i) lanes[i % 16] += exp_fr(x[i] - m);  // exp8's bits, lane by lane
    return tree16(lanes);
}

}  // namespace forerun
#endif

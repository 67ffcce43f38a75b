// The avx512 path's intrinsics on a CPU without AVX-512, for its tests only: SIMDe's portable
// implementations (Debian's libsimde-dev, header-only), compiled with AVX2, FMA and F16C, and the
// intrinsics SIMDe 0.7.4 lacks written here from AVX2 and F16C with the same results, lane by lane.
// Included by avx512.cpp only when build.py compiles the emulated library (FORERUN_EMULATE_AVX512=1,
// which defines FORERUN_EMULATED); the real library never sees it.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

namespace forerun_emulated {

struct Ps { float f[16]; };
struct Si { int32_t i[16]; };

inline Ps ps(simde__m512 a) { Ps p; simde_mm512_storeu_ps(p.f, a); return p; }
inline Si si(simde__m512i a) { Si s; simde_mm512_storeu_si512(s.i, a); return s; }
inline __m256 lo(const Ps& p) { return _mm256_loadu_ps(p.f); }
inline __m256 hi(const Ps& p) { return _mm256_loadu_ps(p.f + 8); }
inline simde__m512 join(__m256 l, __m256 h) {
    Ps p;
    _mm256_storeu_ps(p.f, l);
    _mm256_storeu_ps(p.f + 8, h);
    return simde_mm512_loadu_ps(p.f);
}
inline simde__m512i join(__m256i l, __m256i h) {
    Si s;
    _mm256_storeu_si256((__m256i*)s.i, l);
    _mm256_storeu_si256((__m256i*)(s.i + 8), h);
    return simde_mm512_loadu_si512(s.i);
}
inline __m256i native(simde__m256i a) { __m256i n; memcpy(&n, &a, 32); return n; }
inline __m128i native(simde__m128i a) { __m128i n; memcpy(&n, &a, 16); return n; }

inline simde__m512 cvtph_ps(simde__m256i a) {
    const __m256i n = native(a);
    return join(_mm256_cvtph_ps(_mm256_castsi256_si128(n)), _mm256_cvtph_ps(_mm256_extracti128_si256(n, 1)));
}
// The path converts only under round-to-nearest-even (a constant): F16C's conversion under it.
inline simde__m256i cvtps_ph(simde__m512 a) {
    const Ps p = ps(a);
    const __m256i h = _mm256_set_m128i(_mm256_cvtps_ph(hi(p), _MM_FROUND_TO_NEAREST_INT),
                                       _mm256_cvtps_ph(lo(p), _MM_FROUND_TO_NEAREST_INT));
    simde__m256i out;
    memcpy(&out, &h, 32);
    return out;
}
inline simde__m512 cvtepi32_ps(simde__m512i a) {
    const Si s = si(a);
    return join(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)s.i)),
                _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(s.i + 8))));
}
inline simde__m512i cvtps_epi32(simde__m512 a) {
    const Ps p = ps(a);
    return join(_mm256_cvtps_epi32(lo(p)), _mm256_cvtps_epi32(hi(p)));
}
inline simde__m512i cvttps_epi32(simde__m512 a) {
    const Ps p = ps(a);
    return join(_mm256_cvttps_epi32(lo(p)), _mm256_cvttps_epi32(hi(p)));
}
inline simde__m512i cvtepu8_epi16(simde__m256i a) {
    const __m256i n = native(a);
    return join(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(n)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(n, 1)));
}
inline simde__m512i cvtepu8_epi32(simde__m128i a) {
    const __m128i n = native(a);
    return join(_mm256_cvtepu8_epi32(n), _mm256_cvtepu8_epi32(_mm_srli_si128(n, 8)));
}
// Masked loads and stores touch only the lanes the mask names, as the instructions do.
inline simde__m512 mask_loadu_ps(simde__m512 src, simde__mmask16 k, const void* p) {
    Ps out = ps(src);
    for (int i = 0; i < 16; ++i)
        if (k >> i & 1) out.f[i] = ((const float*)p)[i];
    return simde_mm512_loadu_ps(out.f);
}
inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 a) {
    const Ps v = ps(a);
    for (int i = 0; i < 16; ++i)
        if (k >> i & 1) ((float*)p)[i] = v.f[i];
}
inline simde__m512 shuffle_f32x4(simde__m512 a, simde__m512 b, int imm) {
    const Ps pa = ps(a), pb = ps(b);
    Ps out;
    for (int q = 0; q < 4; ++q)
        memcpy(out.f + 4 * q, (q < 2 ? pa.f : pb.f) + 4 * (imm >> (2 * q) & 3), 16);
    return simde_mm512_loadu_ps(out.f);
}
inline float reduce_max_ps(simde__m512 a) {   // GCC's own order of maxima (a NaN lands as there)
    const Ps p = ps(a);
    const __m256 t1 = _mm256_max_ps(lo(p), hi(p));
    const __m128 t2 = _mm_max_ps(_mm256_castps256_ps128(t1), _mm256_extractf128_ps(t1, 1));
    const __m128 t3 = _mm_max_ps(t2, _mm_shuffle_ps(t2, t2, 0x4e));
    return _mm_cvtss_f32(_mm_max_ps(t3, _mm_shuffle_ps(t3, t3, 0xb1)));
}

}  // namespace forerun_emulated

#undef _mm512_cvtph_ps
#undef _mm512_cvtps_ph
#undef _mm512_cvtepi32_ps
#undef _mm512_cvtps_epi32
#undef _mm512_cvttps_epi32
#undef _mm512_cvtepu8_epi16
#undef _mm512_cvtepu8_epi32
#undef _mm512_maskz_loadu_ps
#undef _mm512_mask_loadu_ps
#undef _mm512_mask_storeu_ps
#undef _mm512_shuffle_f32x4
#undef _mm512_reduce_max_ps
#undef _mm512_mask_cmp_ps_mask
#define _mm512_cvtph_ps(a) forerun_emulated::cvtph_ps(a)
#define _mm512_cvtps_ph(a, rounding) forerun_emulated::cvtps_ph(a)
#define _mm512_cvtepi32_ps(a) forerun_emulated::cvtepi32_ps(a)
#define _mm512_cvtps_epi32(a) forerun_emulated::cvtps_epi32(a)
#define _mm512_cvttps_epi32(a) forerun_emulated::cvttps_epi32(a)
#define _mm512_cvtepu8_epi16(a) forerun_emulated::cvtepu8_epi16(a)
#define _mm512_cvtepu8_epi32(a) forerun_emulated::cvtepu8_epi32(a)
#define _mm512_maskz_loadu_ps(k, p) forerun_emulated::mask_loadu_ps(simde_mm512_setzero_ps(), k, p)
#define _mm512_mask_loadu_ps(src, k, p) forerun_emulated::mask_loadu_ps(src, k, p)
#define _mm512_mask_storeu_ps(p, k, a) forerun_emulated::mask_storeu_ps(p, k, a)
#define _mm512_shuffle_f32x4(a, b, imm) forerun_emulated::shuffle_f32x4(a, b, imm)
#define _mm512_reduce_max_ps(a) forerun_emulated::reduce_max_ps(a)
// The predicate must stay a constant for _mm256_cmp_ps: a macro, not a function.
#define _mm512_mask_cmp_ps_mask(k, a, b, imm)                                                            \
    ([&]() -> simde__mmask16 {                                                                          \
        const forerun_emulated::Ps pa_ = forerun_emulated::ps(a), pb_ = forerun_emulated::ps(b);        \
        const int hits_ = _mm256_movemask_ps(_mm256_cmp_ps(forerun_emulated::lo(pa_), forerun_emulated::lo(pb_), imm)) | \
                          _mm256_movemask_ps(_mm256_cmp_ps(forerun_emulated::hi(pa_), forerun_emulated::hi(pb_), imm)) << 8; \
        return (simde__mmask16)(hits_ & (k));                                                           \
    }())

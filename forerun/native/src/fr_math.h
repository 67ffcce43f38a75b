// The exponential every path computes, as a sequence of correctly rounded operations, so a vector
// path that performs the same operations lane by lane gives the same bits (avx2.cpp, avx512.cpp).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace forerun {

// Cephes' expf: x clamped to [-87, 88], n = round(x / ln 2), r = x - n ln 2 in two parts, a
// degree-6 polynomial in r, times 2^n built from its bits. About 1 ulp.
constexpr float EXP_LO = -87.0f, EXP_HI = 88.0f, LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = -0.693359375f, LN2_LO = 2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_fr(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    const float n = nearbyintf(x * LOG2E);
    float r = fmaf(n, LN2_HI, x);
    r = fmaf(n, LN2_LO, r);
    float p = EXP_P[0];
    for (int i = 1; i < 6; ++i) p = fmaf(p, r, EXP_P[i]);
    p = fmaf(p, r * r, r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

// silu(g) * u = g / (1 + e^-g) * u.
inline float silu_mul_fr(float g, float u) { return g / (1.0f + exp_fr(-g)) * u; }

// Lanes [0, 16) summed as ((l + l+8) + (l+4 ...)) ...: the same tree on every path.
inline float tree16(const float* a) {
    float t8[8], t4[4];
    for (int l = 0; l < 8; ++l) t8[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; ++l) t4[l] = t8[l] + t8[l + 4];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

// sum_i a[i] * b[i], n a multiple of 16: lane l accumulates i = l (mod 16) with fma, in order, and
// the lanes end in tree16. The reference for each path's dot16 (one vector or two, the same bits).
inline float dot16_fr(const float* a, const float* b, int64_t n) {
    float acc[16] = {};
    for (int64_t i = 0; i < n; i += 16)
        for (int l = 0; l < 16; ++l) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    return tree16(acc);
}

}  // namespace forerun

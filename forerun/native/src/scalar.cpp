// The portable path: the reference every vector path is tested against bit for bit, and the
// path of CPUs with neither AVX2 nor AVX-512. Written for clarity, one output at a time.
#include <math.h>
#include <string.h>

#include <math.h>
#include <omp.h>

#include "fr_math.h"
#include "kernels.h"

namespace forerun {

namespace {

int8_t to_level(float v) {
    // Round half to even, as the vector paths' conversion does (finite inputs).
    float r = nearbyintf(v);
    if (r > 127.0f) r = 127.0f;
    if (r < -128.0f) r = -128.0f;
    return (int8_t)r;
}

uint16_t rd16(const uint8_t* p) { uint16_t v; memcpy(&v, p, 2); return v; }

// The stored (unsigned) 4-bit value of input k (0..31) of a 32-input unit's nibble vectors.
int nibble(const uint8_t* qs, int lane, int k) {
    const int g = k / 4, i = k % 4;
    return g < 4 ? qs[64 * g + lane * 4 + i] & 0xF : qs[64 * (g - 4) + lane * 4 + i] >> 4;
}

int bit4(const uint8_t* qh, int lane, int k) {
    return ((qh[lane * 4 + k % 4] >> (k / 4)) & 1) << 4;
}

float f16(const uint8_t* base, int lane) { return f16_to_f32(rd16(base + 2 * lane)); }

// One output lane of one chunk against one activation block (or, for K-quants, one super-block).
float kquant_block(int type, const uint8_t* c, int lane, const int8_t* x, const ActRow& a, int64_t b, float acc) {
    const float dx = a.d[b];
    if (type == Q6_K) {
        int32_t s = 0;
        for (int j = 0; j < 16; ++j) {
            int32_t p = -32 * a.sum16[16 * b + j];
            for (int i = 0; i < 16; ++i) {
                const int k = 16 * j + i, u = k / 32, kk = k % 32, g = kk / 4;
                int q = nibble(c + q6k::QL + 256 * u, lane, kk);
                q |= ((c[q6k::QH + 128 * u + 64 * (g / 4) + lane * 4 + kk % 4] >> (2 * (g % 4))) & 3) << 4;
                p += q * x[k];
            }
            s += (int32_t)(int8_t)c[q6k::SC + 16 * j + lane] * p;
        }
        return fmaf(f16(c + q6k::D, lane) * dx, (float)s, acc);
    }
    int32_t s1 = 0, s2 = 0;
    for (int j = 0; j < 8; ++j) {
        int32_t p = 0;
        for (int kk = 0; kk < 32; ++kk) {
            int q = nibble(c + q4k::QS + 256 * j, lane, kk);
            if (type == Q5_K) q |= bit4(c + q4k::QH + 64 * j, lane, kk);
            p += q * x[32 * j + kk];
        }
        s1 += (int32_t)c[q4k::SC + 16 * j + lane] * p;
        s2 += (int32_t)c[q4k::MN + 32 * (j / 2) + 2 * lane + j % 2] * a.sum32h[8 * b + j];
    }
    acc = fmaf(f16(c + q4k::D, lane) * dx, (float)s1, acc);
    return fmaf(-(f16(c + q4k::DMIN, lane) * dx), (float)s2, acc);
}

float legacy_block(int type, const uint8_t* c, int lane, const int8_t* x, const ActRow& a, int64_t b, float acc) {
    const float dx = a.d[b];
    int32_t p = 0;
    switch (type) {
        case Q8_0:
            for (int k = 0; k < 32; ++k) p += (int8_t)c[q8_0::Q + 64 * (k / 4) + lane * 4 + k % 4] * x[k];
            return fmaf(f16(c + q8_0::D, lane) * dx, (float)p, acc);
        case Q4_0: case Q5_0: {
            p = (type == Q4_0 ? -8 : -16) * a.sum32[b];
            for (int k = 0; k < 32; ++k) {
                int q = nibble(c + q4_0::QS, lane, k);
                if (type == Q5_0) q |= bit4(c + q4_0::QH, lane, k);
                p += q * x[k];
            }
            return fmaf(f16(c + q4_0::D, lane) * dx, (float)p, acc);
        }
        case Q4_1: case Q5_1: {
            for (int k = 0; k < 32; ++k) {
                int q = nibble(c + q4_1::QS, lane, k);
                if (type == Q5_1) q |= bit4(c + q4_1::QH, lane, k);
                p += q * x[k];
            }
            acc = fmaf(f16(c + q4_1::D, lane) * dx, (float)p, acc);
            return fmaf(f16(c + q4_1::M, lane) * dx, (float)a.sum32[b], acc);
        }
        default:
            return acc;
    }
}

}  // namespace

void quantize_scalar(const float* x, int64_t m, int64_t k, int64_t ldx, int qb, uint8_t* act) {
    const size_t stride = act_row_bytes(k);
    for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * ldx;
        uint8_t* base = act + r * stride;
        ActRow a = act_row(base, k, qb);
        int8_t* q = const_cast<int8_t*>(a.q);
        float* d = const_cast<float*>(a.d);
        for (int64_t b = 0; b < k / qb; ++b) {
            float amax = 0.0f;
            for (int i = 0; i < qb; ++i) amax = fmaxf(amax, fabsf(xr[b * qb + i]));
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            d[b] = amax / 127.0f;
            for (int i = 0; i < qb; ++i) q[b * qb + i] = to_level(xr[b * qb + i] * id);
        }
        act_sums(q, k, base);
    }
}

void matmul_scalar(int type, const uint8_t* w, int64_t k, const uint8_t* act, int64_t m, int64_t tile0,
                   int64_t tile1, int64_t n, float* y, int64_t ldy, const float* bias) {
    const int qb = block_inputs(type), cb = chunk_bytes(type);
    const int64_t blocks = k / qb;
    const size_t stride = act_row_bytes(k);
    const bool kquant = qb == QK_K;
    for (int64_t t = tile0; t < tile1; ++t) {
        for (int lane = 0; lane < LANES; ++lane) {
            const int64_t col = t * LANES + lane;
            if (col >= n) break;
            for (int64_t r = 0; r < m; ++r) {
                const ActRow a = act_row(act + r * stride, k, qb);
                float acc = 0.0f;
                for (int64_t b = 0; b < blocks; ++b) {
                    const uint8_t* c = w + ((size_t)t * blocks + b) * cb;
                    acc = kquant ? kquant_block(type, c, lane, a.q + b * qb, a, b, acc)
                                 : legacy_block(type, c, lane, a.q + b * qb, a, b, acc);
                }
                y[r * ldy + col] = bias ? acc + bias[col] : acc;
            }
        }
    }
}

namespace {
inline float dot16(const float* a, const float* b, int64_t n) { return dot16_fr(a, b, n); }
inline void dots16(const float* q, const float* const* k, int64_t n, float* out) {
    for (int j = 0; j < 16; ++j) out[j] = dot16_fr(q, k[j], n);
}
void to_half(const float* x, uint16_t* h, int64_t n) {
    for (int64_t i = 0; i < n; ++i) h[i] = f32_to_f16(x[i]);
}
void from_half(const uint16_t* h, float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = f16_to_f32(h[i]);
}
void exp_shift(float* p, int64_t n, float sub) {
    for (int64_t i = 0; i < n; ++i) p[i] = exp_fr(p[i] - sub);
}
void silu_mul(float* gate, const float* up, int64_t n) {
    for (int64_t i = 0; i < n; ++i) gate[i] = silu_mul_fr(gate[i], up[i]);
}
constexpr int WEIGH_HEADS = 4, WEIGH_SUMS = 8;   // the order of every sum is the same whatever these are
#define FR_QUANTIZE quantize_scalar
#define FR_MATMUL matmul_scalar
#include "layer_impl.h"
#undef FR_QUANTIZE
#undef FR_MATMUL
}  // namespace

void layer_scalar(const LayerDesc& l, const PassDesc& pass, int64_t layer, float* x, int id, int threads) {
    run_layer(l, pass, layer, x, id, threads);
}

void norm_head_scalar(const Product& head, const float* gain, float eps, const PassDesc& pass, const float* x,
                       int64_t ldx, float* h, float* y, int id, int threads) {
    run_norm_head(head, gain, eps, pass, x, ldx, h, y, id, threads);
}

void rmsnorm_scalar(const float* x, int64_t m, int64_t n, int64_t ldx, const float* gain, float eps, float* out) {
    for (int64_t r = 0; r < m; ++r) rmsnorm(x + r * ldx, gain, eps, n, out + r * n);
}

int64_t argmax_scalar(const float* x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (x[i] != x[i]) return i;  // the first NaN
        if (x[i] > x[best]) best = i;
    }
    return best;
}

float sum_exp_scalar(const float* x, int64_t n, float m) {
    float lanes[16] = {};
    for (int64_t i = 0; i < n; ++i) lanes[i % 16] += exp_fr(x[i] - m);
    return tree16(lanes);
}

}  // namespace forerun

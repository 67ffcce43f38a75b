// GGUF's blocks decoded to their integers, repacked into the tile layout of kernels.h, and
// dequantized rows (an embedding's looked-up rows). Plain C++, the same on every CPU.
#include <string.h>

#include "kernels.h"

namespace forerun {

int block_inputs(int type) {
    switch (type) {
        case Q4_K: case Q5_K: case Q6_K: return QK_K;
        case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return QK_0;
        default: return 0;
    }
}

int gguf_block_bytes(int type) {
    switch (type) {
        case Q4_0: return GGUF_BYTES_Q4_0;
        case Q4_1: return GGUF_BYTES_Q4_1;
        case Q5_0: return GGUF_BYTES_Q5_0;
        case Q5_1: return GGUF_BYTES_Q5_1;
        case Q8_0: return GGUF_BYTES_Q8_0;
        case Q4_K: return GGUF_BYTES_Q4_K;
        case Q5_K: return GGUF_BYTES_Q5_K;
        case Q6_K: return GGUF_BYTES_Q6_K;
        default: return 0;
    }
}

int chunk_bytes(int type) {
    switch (type) {
        case Q4_0: return q4_0::BYTES;
        case Q4_1: return q4_1::BYTES;
        case Q5_0: return q5_0::BYTES;
        case Q5_1: return q5_1::BYTES;
        case Q8_0: return q8_0::BYTES;
        case Q4_K: return q4k::BYTES;
        case Q5_K: return q5k::BYTES;
        case Q6_K: return q6k::BYTES;
        default: return 0;
    }
}

namespace {
// Bytes of a quantized row's parts, in order (kernels.h): q, d per 32 (room for either block
// size), sum16, sum32, sum32h, sum16h, off8; each part 64-aligned.
constexpr int PARTS = 7;
void act_parts(int64_t k, size_t* bytes) {
    const size_t raw[PARTS] = {(size_t)k, (size_t)k / 32 * 4, (size_t)k / 16 * 4, (size_t)k / 32 * 4,
                               (size_t)k / 32 * 2, (size_t)k / 16 * 2, (size_t)k / 8 * 4};
    for (int i = 0; i < PARTS; ++i) bytes[i] = (raw[i] + 63) / 64 * 64;
}
}  // namespace

size_t act_row_bytes(int64_t k) {
    size_t bytes[PARTS], total = 0;
    act_parts(k, bytes);
    for (int i = 0; i < PARTS; ++i) total += bytes[i];
    return total;
}

void act_sums(const int8_t* q, int64_t k, uint8_t* row) {
    const ActRow a = act_row(row, k, 0);
    int32_t* s16 = const_cast<int32_t*>(a.sum16);
    int16_t* s16h = const_cast<int16_t*>(a.sum16h);
    int32_t* o8 = const_cast<int32_t*>(a.off8);
    for (int64_t j = 0; j < k / 16; ++j) {
        int32_t lo = 0, hi = 0;
        for (int i = 0; i < 8; ++i) lo += q[16 * j + i], hi += q[16 * j + 8 + i];
        o8[2 * j] = -32 * lo;
        o8[2 * j + 1] = -32 * hi;
        s16[j] = lo + hi;
        s16h[j] = (int16_t)(lo + hi);
    }
    for (int64_t j = 0; j < k / 32; ++j) {
        const_cast<int32_t*>(a.sum32)[j] = s16[2 * j] + s16[2 * j + 1];
        const_cast<int16_t*>(a.sum32h)[j] = (int16_t)(s16[2 * j] + s16[2 * j + 1]);
    }
}

ActRow act_row(const uint8_t* base, int64_t k, int qb) {
    (void)qb;
    size_t bytes[PARTS];
    act_parts(k, bytes);
    const uint8_t* p[PARTS];
    p[0] = base;
    for (int i = 1; i < PARTS; ++i) p[i] = p[i - 1] + bytes[i - 1];
    ActRow r;
    r.q = reinterpret_cast<const int8_t*>(p[0]);
    r.d = reinterpret_cast<const float*>(p[1]);
    r.sum16 = reinterpret_cast<const int32_t*>(p[2]);
    r.sum32 = reinterpret_cast<const int32_t*>(p[3]);
    r.sum32h = reinterpret_cast<const int16_t*>(p[4]);
    r.sum16h = reinterpret_cast<const int16_t*>(p[5]);
    r.off8 = reinterpret_cast<const int32_t*>(p[6]);
    return r;
}

float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (mant << 13);                 // inf / nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);        // normal
    } else if (mant == 0) {
        bits = sign;                                             // zero
    } else {                                                     // subnormal: normalise
        int e = -1;
        do { mant <<= 1; ++e; } while (!(mant & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, abs = x & 0x7fffffff;
    if (abs > 0x7f800000) return (uint16_t)(sign | 0x7e00 | ((abs >> 13) & 0x3ff));  // NaN
    if (abs >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  // 65520 and up round to infinity
    uint32_t h, rest, half;
    if (abs >= 0x38800000) {                                  // a normal half: 13 bits dropped
        h = ((abs >> 23) - 112) << 10 | ((abs >> 13) & 0x3ff);
        rest = abs & 0x1fff;
        half = 0x1000;
    } else {                                                  // a subnormal half (or zero)
        const uint32_t shift = 126 - (abs >> 23), m = (abs & 0x7fffff) | 0x800000;
        if (shift > 24) return (uint16_t)sign;                // below half the smallest subnormal
        h = m >> shift;
        rest = m & ((1u << shift) - 1);
        half = 1u << (shift - 1);
    }
    if (rest > half || (rest == half && (h & 1))) ++h;        // a carry runs into the exponent
    return (uint16_t)(sign | h);
}

namespace {

uint16_t rd16(const uint8_t* p) { uint16_t v; memcpy(&v, p, 2); return v; }
uint32_t rd32(const uint8_t* p) { uint32_t v; memcpy(&v, p, 4); return v; }

// One GGUF block as integers: q as stored (unsigned, but Q8_0 signed), its scales, its f16 factors.
struct Decoded {
    uint16_t d = 0, dmin = 0;   // f16 bits; dmin is Q4_1/Q5_1's m too
    uint8_t sc[16] = {};        // K-quant sub-block scales (Q6_K: int8 bits)
    uint8_t mn[8] = {};         // Q4_K / Q5_K sub-block mins
    uint8_t q[QK_K] = {};       // Q8_0: int8 bits
};

void scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

void decode(int type, const uint8_t* b, Decoded& out) {
    switch (type) {
        case Q4_K: case Q5_K: {
            out.d = rd16(b);
            out.dmin = rd16(b + 2);
            const uint8_t* scales = b + 4;
            for (int j = 0; j < 8; ++j) scale_min_k4(j, scales, &out.sc[j], &out.mn[j]);
            const uint8_t* qh = b + 16;
            const uint8_t* qs = type == Q4_K ? b + 16 : b + 48;
            for (int c = 0; c < 4; ++c) {
                for (int l = 0; l < 32; ++l) {
                    uint8_t lo = qs[32 * c + l] & 0xF, hi = qs[32 * c + l] >> 4;
                    if (type == Q5_K) {
                        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    }
                    out.q[64 * c + l] = lo;
                    out.q[64 * c + 32 + l] = hi;
                }
            }
            break;
        }
        case Q6_K: {
            const uint8_t* ql = b;
            const uint8_t* qh = b + 128;
            memcpy(out.sc, b + 192, 16);
            out.d = rd16(b + 208);
            for (int h = 0; h < 2; ++h) {
                const uint8_t* l_ = ql + 64 * h;
                const uint8_t* h_ = qh + 32 * h;
                uint8_t* q = out.q + 128 * h;
                for (int l = 0; l < 32; ++l) {
                    q[l] = (l_[l] & 0xF) | (((h_[l] >> 0) & 3) << 4);
                    q[l + 32] = (l_[l + 32] & 0xF) | (((h_[l] >> 2) & 3) << 4);
                    q[l + 64] = (l_[l] >> 4) | (((h_[l] >> 4) & 3) << 4);
                    q[l + 96] = (l_[l + 32] >> 4) | (((h_[l] >> 6) & 3) << 4);
                }
            }
            break;
        }
        case Q8_0:
            out.d = rd16(b);
            memcpy(out.q, b + 2, 32);
            break;
        case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
            out.d = rd16(b);
            const bool has_m = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
            int off = 2;
            if (has_m) { out.dmin = rd16(b + 2); off = 4; }
            uint32_t qh = 0;
            if (five) { qh = rd32(b + off); off += 4; }
            const uint8_t* qs = b + off;
            for (int l = 0; l < 16; ++l) {
                uint8_t lo = qs[l] & 0xF, hi = qs[l] >> 4;
                if (five) {
                    lo |= ((qh >> l) & 1) << 4;
                    hi |= ((qh >> (l + 16)) & 1) << 4;
                }
                out.q[l] = lo;
                out.q[l + 16] = hi;
            }
            break;
        }
        default:
            break;
    }
}

// The 4 nibble vectors of 32 inputs of 16 lanes: q[lane][0..32) -> 256 bytes.
void put_nibbles(uint8_t* dst, const Decoded* lanes, int offset) {
    for (int v = 0; v < 4; ++v)
        for (int lane = 0; lane < LANES; ++lane)
            for (int i = 0; i < 4; ++i) {
                uint8_t lo = lanes[lane].q[offset + 4 * v + i] & 0xF;
                uint8_t hi = lanes[lane].q[offset + 4 * (v + 4) + i] & 0xF;
                dst[64 * v + lane * 4 + i] = (uint8_t)(lo | (hi << 4));
            }
}

// The bit-4 plane of 32 inputs of 16 lanes: 64 bytes, bit g of byte (lane * 4 + i) from k-group g.
void put_bit4(uint8_t* dst, const Decoded* lanes, int offset) {
    for (int lane = 0; lane < LANES; ++lane)
        for (int i = 0; i < 4; ++i) {
            uint8_t byte = 0;
            for (int g = 0; g < 8; ++g)
                if (lanes[lane].q[offset + 4 * g + i] & 0x10) byte |= (uint8_t)(1 << g);
            dst[lane * 4 + i] = byte;
        }
}

void put_f16s(uint8_t* dst, const Decoded* lanes, bool second) {
    for (int lane = 0; lane < LANES; ++lane) {
        uint16_t v = second ? lanes[lane].dmin : lanes[lane].d;
        memcpy(dst + 2 * lane, &v, 2);
    }
}

void write_chunk(int type, const Decoded* lanes, uint8_t* c) {
    switch (type) {
        case Q4_K: case Q5_K:
            put_f16s(c + q4k::D, lanes, false);
            put_f16s(c + q4k::DMIN, lanes, true);
            for (int j = 0; j < 8; ++j)
                for (int lane = 0; lane < LANES; ++lane) c[q4k::SC + 16 * j + lane] = lanes[lane].sc[j];
            for (int i = 0; i < 4; ++i)
                for (int lane = 0; lane < LANES; ++lane) {
                    c[q4k::MN + 32 * i + 2 * lane] = lanes[lane].mn[2 * i];
                    c[q4k::MN + 32 * i + 2 * lane + 1] = lanes[lane].mn[2 * i + 1];
                }
            for (int j = 0; j < 8; ++j) put_nibbles(c + q4k::QS + 256 * j, lanes, 32 * j);
            if (type == Q5_K)
                for (int j = 0; j < 8; ++j) put_bit4(c + q4k::QH + 64 * j, lanes, 32 * j);
            break;
        case Q6_K:
            put_f16s(c + q6k::D, lanes, false);
            for (int j = 0; j < 16; ++j)
                for (int lane = 0; lane < LANES; ++lane) c[q6k::SC + 16 * j + lane] = lanes[lane].sc[j];
            for (int u = 0; u < 8; ++u) {
                put_nibbles(c + q6k::QL + 256 * u, lanes, 32 * u);
                for (int h = 0; h < 2; ++h)
                    for (int lane = 0; lane < LANES; ++lane)
                        for (int i = 0; i < 4; ++i) {
                            uint8_t byte = 0;
                            for (int s = 0; s < 4; ++s)
                                byte |= (uint8_t)(((lanes[lane].q[32 * u + 4 * (4 * h + s) + i] >> 4) & 3) << (2 * s));
                            c[q6k::QH + 128 * u + 64 * h + lane * 4 + i] = byte;
                        }
            }
            break;
        case Q8_0:
            put_f16s(c + q8_0::D, lanes, false);
            for (int g = 0; g < 8; ++g)
                for (int lane = 0; lane < LANES; ++lane)
                    for (int i = 0; i < 4; ++i) c[q8_0::Q + 64 * g + lane * 4 + i] = lanes[lane].q[4 * g + i];
            break;
        case Q4_0: case Q5_0:
            put_f16s(c + q4_0::D, lanes, false);
            put_nibbles(c + q4_0::QS, lanes, 0);
            if (type == Q5_0) put_bit4(c + q4_0::QH, lanes, 0);
            break;
        case Q4_1: case Q5_1:
            put_f16s(c + q4_1::D, lanes, false);
            put_f16s(c + q4_1::M, lanes, true);
            put_nibbles(c + q4_1::QS, lanes, 0);
            if (type == Q5_1) put_bit4(c + q4_1::QH, lanes, 0);
            break;
        default:
            break;
    }
}

}  // namespace

// Tiles [tile0, tile1) of a GGUF tensor of n rows, k inputs each (the file's row-major blocks).
void repack_tiles(int type, const uint8_t* src, int64_t n, int64_t k, int64_t tile0, int64_t tile1, uint8_t* dst) {
    const int qb = block_inputs(type), gb = gguf_block_bytes(type), cb = chunk_bytes(type);
    const int64_t blocks = k / qb;
    const size_t row_bytes = (size_t)blocks * gb;
    Decoded lanes[LANES];
    for (int64_t t = tile0; t < tile1; ++t) {
        for (int64_t b = 0; b < blocks; ++b) {
            for (int lane = 0; lane < LANES; ++lane) {
                int64_t row = t * LANES + lane;
                lanes[lane] = Decoded();
                if (row < n) decode(type, src + row * row_bytes + b * gb, lanes[lane]);
            }
            write_chunk(type, lanes, dst + ((size_t)t * blocks + b) * cb);
        }
    }
}

// Rows `rows` of a GGUF tensor (k inputs each) as float32, as gguf-py dequantizes them.
void dequantize_rows(int type, const uint8_t* src, int64_t k, const int64_t* rows, int64_t count, float* out) {
    const int qb = block_inputs(type), gb = gguf_block_bytes(type);
    const int64_t blocks = k / qb;
    const size_t row_bytes = (size_t)blocks * gb;
    Decoded blk;
    for (int64_t r = 0; r < count; ++r) {
        const uint8_t* row = src + rows[r] * row_bytes;
        float* o = out + r * k;
        for (int64_t b = 0; b < blocks; ++b) {
            blk = Decoded();
            decode(type, row + b * gb, blk);
            const float d = f16_to_f32(blk.d), dmin = f16_to_f32(blk.dmin);
            float* ob = o + b * qb;
            switch (type) {
                case Q4_K: case Q5_K:
                    for (int j = 0; j < 8; ++j) {
                        const float ds = d * (float)blk.sc[j], dm = dmin * (float)blk.mn[j];
                        for (int i = 0; i < 32; ++i) ob[32 * j + i] = ds * (float)blk.q[32 * j + i] - dm;
                    }
                    break;
                case Q6_K:
                    for (int j = 0; j < 16; ++j) {
                        const float ds = d * (float)(int8_t)blk.sc[j];
                        for (int i = 0; i < 16; ++i) ob[16 * j + i] = ds * (float)((int)blk.q[16 * j + i] - 32);
                    }
                    break;
                case Q8_0:
                    for (int i = 0; i < 32; ++i) ob[i] = (float)(int8_t)blk.q[i] * d;
                    break;
                case Q4_0:
                    for (int i = 0; i < 32; ++i) ob[i] = d * (float)((int)blk.q[i] - 8);
                    break;
                case Q5_0:
                    for (int i = 0; i < 32; ++i) ob[i] = d * (float)((int)blk.q[i] - 16);
                    break;
                case Q4_1: case Q5_1:
                    for (int i = 0; i < 32; ++i) ob[i] = d * (float)blk.q[i] + dmin;
                    break;
                default:
                    break;
            }
        }
    }
}

}  // namespace forerun

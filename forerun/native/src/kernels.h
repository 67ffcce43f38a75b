// forerun's native products over GGUF's own weight blocks: y[m, n] = sum_k x[m, k] * W[n, k].
//
// Shared by every instruction-set path (scalar.cpp, avx2.cpp, avx512.cpp): the formats, the
// repacked weight layout, the quantized activation layout, and the exact arithmetic every path
// performs, so that a path's result is bit-identical to the scalar reference.
//
// The arithmetic, for one output (m, n) and the weight blocks b = 0, 1, ... of row n in order:
//   integer part  S = the block's sum of q_w * q_x with the block's integer sub-scales applied
//                 (exact in int32 whatever order it is summed in);
//   float part    acc = fma(d_w * d_x, (float)S, acc), plus for formats with a min/offset a second
//                 fma with its own integer sum. acc starts at 0 and runs over the blocks in order.
// Every lane of a vector path is one (m, n) doing exactly these float operations in this order, so
// a row's result never depends on how many rows are computed with it, on the tile, on the thread
// split, or on the path.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "layer.h"

namespace forerun {

// GGML's type ids (gguf.GGMLQuantizationType).
enum Type : int {
    Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
};

constexpr int LANES = 16;           // outputs per repacked tile
constexpr int QK_K = 256;           // K-quant super-block
constexpr int QK_0 = 32;            // legacy block

// --- GGUF's own blocks (the file's bytes) ---------------------------------------------------
constexpr int GGUF_BYTES_Q4_0 = 18, GGUF_BYTES_Q4_1 = 20, GGUF_BYTES_Q5_0 = 22, GGUF_BYTES_Q5_1 = 24,
              GGUF_BYTES_Q8_0 = 34, GGUF_BYTES_Q4_K = 144, GGUF_BYTES_Q5_K = 176, GGUF_BYTES_Q6_K = 210;

// --- the repacked layout: per tile of 16 outputs, per block, one chunk ------------------------
// Within a chunk, a "k-group vector" is 64 bytes: byte (lane * 4 + i) belongs to output lane and
// to the 4 consecutive inputs k = 4g + i of k-group g, the operand of one 4-way integer dot product
// per lane. Nibble vectors hold k-group g in the low nibbles and k-group g + 4 in the high ones.
// A high-bit plane (5-bit formats) is 64 bytes per 32-input unit: byte (lane * 4 + i), bit g = the
// fifth bit of that byte's input in k-group g (one shift and mask a group on every vector path).
//
// Q4_K (256 inputs, 8 sub-blocks of 32):
//   d[16] f16 | dmin[16] f16 | sc[8][16] u8 | mn[4][16][2] u8 (mins paired for 16-bit dots) |
//   qs[8 sub-blocks][4 nibble vectors]                                             = 2368 bytes
// Q5_K: Q4_K's chunk, then qh[8 sub-blocks][64] (planes)                           = 2880 bytes
// Q6_K (256 inputs, 16 sub-blocks of 16):
//   d[16] f16 | sc[16][16] i8 | ql[8 units of 32][4 nibble vectors] |
//   qh[8 units][2 vectors]: vector h, byte (lane * 4 + i), bits 2s..2s+1 = the top two bits of
//   k-group 4h + s                                                                  = 3360 bytes
// Q8_0 (32 inputs): d[16] f16 | q[8 k-groups] i8                                    =  544 bytes
// Q4_0: d[16] f16 | qs[4 nibble vectors]                                            =  288 bytes
// Q5_0: d[16] f16 | qs[4 nibble vectors] | qh[64] (plane)                           =  352 bytes
// Q4_1: d[16] f16 | m[16] f16 | qs[4 nibble vectors]                                =  320 bytes
// Q5_1: d[16] f16 | m[16] f16 | qs[4 nibble vectors] | qh[64] (plane)               =  384 bytes
namespace q4k { constexpr int D = 0, DMIN = 32, SC = 64, MN = 192, QS = 320, QH = 2368, BYTES = 2368; }
namespace q5k { constexpr int BYTES = 2880; }
namespace q6k { constexpr int D = 0, SC = 32, QL = 288, QH = 2336, BYTES = 3360; }
namespace q8_0 { constexpr int D = 0, Q = 32, BYTES = 544; }
namespace q4_0 { constexpr int D = 0, QS = 32, QH = 288, BYTES = 288; }
namespace q5_0 { constexpr int BYTES = 352; }
namespace q4_1 { constexpr int D = 0, M = 32, QS = 64, QH = 320, BYTES = 320; }
namespace q5_1 { constexpr int BYTES = 384; }

// --- quantized activations ------------------------------------------------------------------
// One row of K inputs quantized in blocks of QB (256 for K-quant weights, 32 for the others):
//   q[K] i8 | d[K / QB] f32 | sum16[K / 16] i32 | sum32[K / 32] i32 | sum32h[K / 32] i16 | sum16h[K / 16] i16 |
//   off8[K / 8] i32
// q = round-half-even(x * (127 / amax)), d = amax / 127 per block (0 and all-zero q when amax = 0);
// sumN are the sums of q over each N inputs (sumNh the same as int16, for 16-bit pair dots); off8 is
// -32 times the sum over each 8 inputs (Q6_K's offset, ready to start a dot product's sum).
struct ActRow {
    const int8_t* q;
    const float* d;
    const int32_t* sum16;
    const int32_t* sum32;
    const int16_t* sum32h;
    const int16_t* sum16h;
    const int32_t* off8;
};

// Fills a quantized row's sums from its levels q (the same on every path).
void act_sums(const int8_t* q, int64_t k, uint8_t* row);

int block_inputs(int type);                    // 256 or 32; 0: not a supported type
int gguf_block_bytes(int type);
int chunk_bytes(int type);
inline int act_block(int type) { return block_inputs(type); }
size_t act_row_bytes(int64_t k);               // bytes of one quantized row (either block size)
ActRow act_row(const uint8_t* base, int64_t k, int qb);

// --- per-path entry points ------------------------------------------------------------------
// Quantize rows [0, m) of x (row stride ldx floats) into act (row stride act_row_bytes(k)).
// matmul: output tiles [tile0, tile1) of every row; y row stride ldy; bias may be null.
// layer: this thread's part of one decoder layer (layer_impl.h), inside a parallel region.
// argmax: the index of x[0, n)'s largest value, the first where several are; a NaN counts as the
// largest (the first NaN), as in torch.argmax. n >= 1.
// sum_exp: the sum over x[0, n) of exp_fr(x[i] - m), x[i]'s term added into lane i % 16 in order and
// the lanes summed by tree16 (fr_math.h): the same bits on every path.
// rmsnorm: rows [0, m) of x (row stride ldx, n a multiple of 16) normalised as the layers' norms
// (layer_impl.h) into out (row stride n).
#define FORERUN_PATH_FUNCTIONS(path)                                                                  \
    int64_t argmax_##path(const float* x, int64_t n);                                                 \
    float sum_exp_##path(const float* x, int64_t n, float m);                                         \
    void rmsnorm_##path(const float* x, int64_t m, int64_t n, int64_t ldx, const float* gain, float eps,  \
                        float* out);                                                                  \
    void quantize_##path(const float* x, int64_t m, int64_t k, int64_t ldx, int qb, uint8_t* act);    \
    void matmul_##path(int type, const uint8_t* w, int64_t k, const uint8_t* act, int64_t m,          \
                       int64_t tile0, int64_t tile1, int64_t n, float* y, int64_t ldy, const float* bias); \
    void layer_##path(const LayerDesc& l, const PassDesc& pass, int64_t layer, float* x, int id, int threads); \
    void norm_head_##path(const Product& head, const float* gain, float eps, const PassDesc& pass, const float* x, \
                          int64_t ldx, float* h, float* y, int id, int threads);

FORERUN_PATH_FUNCTIONS(scalar)
FORERUN_PATH_FUNCTIONS(avx2)
FORERUN_PATH_FUNCTIONS(avx512)

// fp16 -> fp32, exact (the same bits as F16C's conversion).
float f16_to_f32(uint16_t h);
// fp32 -> fp16 rounded to nearest, ties to even (F16C's conversion under that rounding: overflow to
// infinity, a NaN quieted with its payload's top bits).
uint16_t f32_to_f16(float f);

}  // namespace forerun

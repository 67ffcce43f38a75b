// The library's C interface (called through ctypes): what this CPU runs, repacking, activation
// quantization and the product, threads split over output tiles. OpenMP here is the runtime
// PyTorch already loaded (the same libgomp.so.1), so the two share one pool of threads.
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "fr_math.h"
#include "kernels.h"

namespace forerun {
void repack_tiles(int type, const uint8_t* src, int64_t n, int64_t k, int64_t tile0, int64_t tile1, uint8_t* dst);
void dequantize_rows(int type, const uint8_t* src, int64_t k, const int64_t* rows, int64_t count, float* out);
}

using namespace forerun;

namespace {

enum Path : int { SCALAR = 0, AVX2 = 1, AVX512 = 2 };

bool cpu_runs(int path) {
    switch (path) {
        case SCALAR: return true;
#if defined(__x86_64__)
        case AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        case AVX512:
#if defined(FORERUN_EMULATED)
            return true;   // the path's intrinsics emulated (build.py's FORERUN_EMULATE_AVX512): for tests
#else
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
#endif
        default: return false;
    }
}

// Tiles [begin, end) of `tiles` for thread `id` of `count`: contiguous, balanced.
void share(int64_t tiles, int id, int count, int64_t* begin, int64_t* end) {
    *begin = tiles * id / count;
    *end = tiles * (id + 1) / count;
}

int64_t tiles_of(int64_t n) { return (n + LANES - 1) / LANES; }

int64_t argmax_on(int path, const float* x, int64_t n) {
    switch (path) {
#if defined(__x86_64__)
        case AVX512: return argmax_avx512(x, n);
        case AVX2: return argmax_avx2(x, n);
#endif
        default: return argmax_scalar(x, n);
    }
}

float sum_exp_on(int path, const float* x, int64_t n, float m) {
    switch (path) {
#if defined(__x86_64__)
        case AVX512: return sum_exp_avx512(x, n, m);
        case AVX2: return sum_exp_avx2(x, n, m);
#endif
        default: return sum_exp_scalar(x, n, m);
    }
}

}  // namespace

extern "C" {

// Bumped whenever the layout or the arithmetic changes (the Python side checks it).
int fr_abi_version() { return 11; }

// Bit p set: path p (0 scalar, 1 AVX2, 2 AVX-512 VNNI) is built in and runs on this CPU.
int fr_paths() {
    int mask = 0;
    for (int p = SCALAR; p <= AVX512; ++p)
        if (cpu_runs(p)) mask |= 1 << p;
    return mask;
}

int fr_block_inputs(int type) { return block_inputs(type); }
int fr_gguf_block_bytes(int type) { return gguf_block_bytes(type); }

int64_t fr_packed_bytes(int type, int64_t n, int64_t k) {
    const int qb = block_inputs(type);
    if (qb == 0 || k % qb) return -1;
    return tiles_of(n) * (k / qb) * chunk_bytes(type);
}

int64_t fr_act_row_bytes(int64_t k) { return (int64_t)act_row_bytes(k); }

void fr_repack(int type, const uint8_t* src, int64_t n, int64_t k, uint8_t* dst, int threads) {
    const int64_t tiles = tiles_of(n);
#pragma omp parallel num_threads(threads)
    {
        int64_t begin, end;
        share(tiles, omp_get_thread_num(), omp_get_num_threads(), &begin, &end);
        repack_tiles(type, src, n, k, begin, end, dst);
    }
}

// float32 -> float16 as the layers round a float16 cache's entries (the reference the tests hold to torch's).
void fr_to_half(const float* x, int64_t n, uint16_t* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_f16(x[i]);
}

// Returns -1, or the index of the first entry of `rows` outside [0, stored) (nothing written then).
int64_t fr_dequantize_rows(int type, const uint8_t* src, int64_t k, const int64_t* rows, int64_t count,
                           int64_t stored, float* out) {
    for (int64_t r = 0; r < count; ++r)
        if (rows[r] < 0 || rows[r] >= stored) return r;
    dequantize_rows(type, src, k, rows, count, out);
    return -1;
}

// Rows [0, m) of x quantized in blocks of qb (256 or 32) into act.
void fr_quantize(int path, const float* x, int64_t m, int64_t k, int64_t ldx, int qb, uint8_t* act) {
    switch (path) {
#if defined(__x86_64__)
        case AVX512: quantize_avx512(x, m, k, ldx, qb, act); break;
        case AVX2: quantize_avx2(x, m, k, ldx, qb, act); break;
#endif
        default: quantize_scalar(x, m, k, ldx, qb, act); break;
    }
}

// out[r] = the index of row r's largest value (torch.argmax's: the first such, a NaN the largest),
// rows [0, m) of x with row stride ldx.
void fr_argmax(int path, const float* x, int64_t m, int64_t n, int64_t ldx, int64_t* out) {
    for (int64_t r = 0; r < m; ++r) {
        const float* row = x + r * ldx;
        out[r] = argmax_on(path, row, n);
    }
}

// out[r] = x[r] normalised as the layers' RMSNorms normalise (gain, eps), rows [0, m) of x with row
// stride ldx, n a multiple of 16; out's row stride n.
void fr_rmsnorm(int path, const float* x, int64_t m, int64_t n, int64_t ldx, const float* gain, float eps, float* out) {
    switch (path) {
#if defined(__x86_64__)
        case AVX512: rmsnorm_avx512(x, m, n, ldx, gain, eps, out); break;
        case AVX2: rmsnorm_avx2(x, m, n, ldx, gain, eps, out); break;
#endif
        default: rmsnorm_scalar(x, m, n, ldx, gain, eps, out); break;
    }
}

// Row x[0, n) (n >= 2) of logits as its softmax's two likeliest entries: idx[0] = fr_argmax's index,
// idx[1] = the first largest of the others; prob[j] = e^(x[idx[j]] - top) / sum_i e^(x[i] - top),
// top = x[idx[0]], each e^ exp_fr's: what a greedy draft asks of a row, without the softmax's rows.
void fr_softmax_top2(int path, const float* x, int64_t n, int64_t* idx, float* prob) {
    const int64_t first = argmax_on(path, x, n);
    int64_t second = first > 0 ? argmax_on(path, x, first) : -1;
    if (first + 1 < n) {
        const int64_t after = first + 1 + argmax_on(path, x + first + 1, n - first - 1);
        if (second < 0 || x[after] > x[second]) second = after;
    }
    const float top = x[first], total = sum_exp_on(path, x, n, top);
    idx[0] = first;
    idx[1] = second;
    prob[0] = 1.0f / total;
    prob[1] = exp_fr(x[second] - top) / total;
}

// y[r, c] = sum_k x[r, k] W[c, k] (+ bias[c]) for rows r < m, outputs c < n, from the repacked w
// and the rows' quantized activations.
void fr_matmul(int path, int type, const uint8_t* w, int64_t n, int64_t k, const uint8_t* act, int64_t m,
               float* y, int64_t ldy, const float* bias, int threads) {
    const int64_t tiles = tiles_of(n);
    if (threads > tiles) threads = (int)tiles;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int64_t begin, end;
        share(tiles, omp_get_thread_num(), omp_get_num_threads(), &begin, &end);
        switch (path) {
#if defined(__x86_64__)
            case AVX512: matmul_avx512(type, w, k, act, m, begin, end, n, y, ldy, bias); break;
            case AVX2: matmul_avx2(type, w, k, act, m, begin, end, n, y, ldy, bias); break;
#endif
            default: matmul_scalar(type, w, k, act, m, begin, end, n, y, ldy, bias); break;
        }
    }
}

// Decoder layers over pass->rows rows (layer.h), layers[order[0]], layers[order[1]], ... in one
// parallel region: x [rows, hidden] is the residual stream, updated in place; in each layer every
// row's key and value are written to its cache slot before any row attends. After layer `keep`
// (-1: none) the stream is copied into `kept` [rows, hidden]. A layer ends with each thread adding
// the residual of its own rows, and the next begins with the same thread normalising the same rows,
// so no barrier stands between layers.
void fr_layers(int path, const LayerDesc* layers, const int64_t* order, int64_t count, const PassDesc* pass,
               float* x, int64_t keep, float* kept, int threads) {
#pragma omp parallel num_threads(threads)
    {
        const int id = omp_get_thread_num(), team = omp_get_num_threads();
        for (int64_t i = 0; i < count; ++i) {
            const int64_t layer = order[i];
            const LayerDesc& l = layers[layer];
            switch (path) {
#if defined(__x86_64__)
                case AVX512: layer_avx512(l, *pass, layer, x, id, team); break;
                case AVX2: layer_avx2(l, *pass, layer, x, id, team); break;
#endif
                default: layer_scalar(l, *pass, layer, x, id, team); break;
            }
            if (layer == keep) {   // this thread's rows, as the residual above left them
                int64_t r0, r1;
                share(pass->rows, id, team, &r0, &r1);
                memcpy(kept + r0 * l.hidden, x + r0 * l.hidden, (r1 - r0) * l.hidden * sizeof(float));
            }
        }
    }
}

// Rows [0, m) of x (row stride ldx) through the final RMSNorm (gain, eps) into h [m, head->in] and
// then the head's product into y [m, head->out]: what a forward after fr_layers does to score its
// rows, in one call; `pass` gives the activation buffers (act_k, act_0, m rows of head->in inputs).
void fr_norm_head(int path, const Product* head, const float* gain, float eps, const PassDesc* pass, const float* x,
                  int64_t ldx, float* h, float* y, int threads) {
#pragma omp parallel num_threads(threads)
    {
        const int id = omp_get_thread_num(), team = omp_get_num_threads();
        switch (path) {
#if defined(__x86_64__)
            case AVX512: norm_head_avx512(*head, gain, eps, *pass, x, ldx, h, y, id, team); break;
            case AVX2: norm_head_avx2(*head, gain, eps, *pass, x, ldx, h, y, id, team); break;
#endif
            default: norm_head_scalar(*head, gain, eps, *pass, x, ldx, h, y, id, team); break;
        }
    }
}

}  // extern "C"

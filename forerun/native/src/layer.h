// One decoder layer of the Llama family (llama, mistral, qwen2, qwen3) over several rows, natively: the
// hot path of decoding and verification, one call a layer instead of a few dozen small ops.
//
// The structures are mirrored by ctypes in forerun/models/native_layer.py; keep them in step.
#pragma once

#include <stdint.h>

namespace forerun {

constexpr int MAX_PARTS = 4;

// One product: the rows of up to four GGUF tensors stacked along the outputs.
struct Product {
    int64_t parts;
    int64_t type[MAX_PARTS];
    int64_t rows[MAX_PARTS];
    const uint8_t* packed[MAX_PARTS];
    int64_t in;                 // inputs (K)
    int64_t out;                // outputs, all parts together
    const float* bias;          // [out] or null
};

struct LayerDesc {
    Product qkv, o, gate_up, down;
    const float* norm1;         // [hidden] input RMSNorm gain
    const float* norm2;         // [hidden] post-attention RMSNorm gain
    float eps;
    float scale;                // attention's 1/sqrt(head_dim)
    int64_t hidden, heads, kv_heads, head_dim, ffn;
    const float* q_norm;        // [head_dim] each query head's RMSNorm gain before rope (qwen3), or null
    const float* k_norm;        // [head_dim] each key head's, or null
};

// One row of the forward: where its key and value go and which cache slots it attends to.
struct RowDesc {
    void* k;                    // its sequence's cache, layer 0: [kv_heads][slots][head_dim]
    void* v;
    int64_t kv_half;            // 1: the cache holds float16 (rounded to nearest even), 0: float32
    int64_t layer_stride;       // entries from one layer's cache to the next
    int64_t slots;              // slots per head
    int64_t write;              // the slot this row's key and value are written to
    int64_t prefix;             // it attends to slots [0, prefix), then
    int64_t n_extra;            // to these slots, in this (logical) order
    const int32_t* extra;
    const float* cos;           // rope tables at this row's position [head_dim]; sin carries
    const float* sin;           // rotate-half's sign (negative first half)
};

struct PassDesc {
    int64_t rows;
    const RowDesc* row;
    float* h;                   // scratch [rows, max(hidden, ffn)]: normalised rows
    float* qkv;                 // [rows, qkv.out]
    float* att;                 // [rows, heads * head_dim]
    float* tmp;                 // [rows, hidden]
    float* gu;                  // [rows, gate_up.out]
    uint8_t* act_k;             // [rows, act_row_bytes(max(hidden, ffn, heads * head_dim))]: 256-blocks
    uint8_t* act_0;             // the same for 32-blocks (a product may mix K-quant and older parts)
    float* scores;              // [threads, scores_stride]
    int64_t scores_stride;      // >= (heads / kv_heads) * (most visible slots, rounded up to 16)
};

}  // namespace forerun

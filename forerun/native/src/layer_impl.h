// A decoder layer over several rows (layer.h), written once and compiled into every path's file
// (scalar.cpp, avx2.cpp, avx512.cpp), each with its own instruction set. Element-wise work is plain
// loops the compiler vectorizes; every reduction (a norm's sum of squares, a dot product, softmax's
// sum) runs over 16 lanes in a fixed order and ends in a fixed tree, and exp is our own polynomial of
// correctly rounded operations, so every path gives the same bits and a row never depends on the
// rows beside it.
//
// Include inside an anonymous namespace of namespace forerun, after defining
//   FR_QUANTIZE(x, m, k, ldx, qb, act) and FR_MATMUL(type, w, k, act, m, tile0, tile1, n, y, ldy, bias)
// as the path's own functions, and the path's exp_shift(p, n, sub): p[i] = e^(p[i] - sub),
// silu_mul(gate, up, n): gate[i] = silu(gate[i]) * up[i], both exp_fr's operations, and
// dot16(a, b, n), dot16_fr's (fr_math.h), dots16(q, keys, n, out): dot16 of q with 16 keys at
// once, and to_half(x, h, n) / from_half(h, x, n): float16 rounded to nearest even and back
// (f32_to_f16, f16_to_f32), n a multiple of 16; and the constants WEIGH_HEADS (query heads weighed
// together, at most 6) and WEIGH_SUMS (16-lane sums one weighing keeps in registers), which the
// path's register file decides.
// (The including file includes <math.h>, <omp.h>, <string.h> and kernels.h first, at file scope.)

constexpr int L = 16;   // lanes of every reduction

inline float sum16(const float* a, int64_t n) {
    float acc[L] = {};
    for (int64_t i = 0; i < n; i += L)
#pragma omp simd
        for (int l = 0; l < L; ++l) acc[l] += a[i + l];
    return tree16(acc);
}

inline void share(int64_t count, int id, int threads, int64_t* begin, int64_t* end) {
    *begin = count * id / threads;
    *end = count * (id + 1) / threads;
}

inline void rmsnorm(const float* x, const float* gain, float eps, int64_t n, float* out) {
    const float r = 1.0f / sqrtf(dot16(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * r) * gain[i];
}

// x [head_dim] rotated in place: x[d] cos[d] + x[d +- D/2] sin[d] (sin carries the sign).
inline void rope(float* x, const float* c, const float* s, int64_t d, float scale) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = fmaf(b, s[i], a * c[i]) * scale;
        x[i + half] = fmaf(a, s[i + half], b * c[i + half]) * scale;
    }
}

inline bool needs(const Product& p, int block) {
    for (int64_t i = 0; i < p.parts; ++i)
        if (block_inputs((int)p.type[i]) == block) return true;
    return false;
}

// Rows [r0, r1) of x (row stride ldx) quantized into whichever activation blocks `p` reads.
inline void quantize_for(const Product& p, const PassDesc& pass, const float* x, int64_t ldx, int64_t r0, int64_t r1) {
    const size_t stride = act_row_bytes(p.in);
    for (int64_t r = r0; r < r1; ++r) {
        if (needs(p, QK_K)) FR_QUANTIZE(x + r * ldx, 1, p.in, ldx, QK_K, pass.act_k + r * stride);
        if (needs(p, QK_0)) FR_QUANTIZE(x + r * ldx, 1, p.in, ldx, QK_0, pass.act_0 + r * stride);
    }
}

// This thread's share of the product's output tiles, every part's tiles numbered in turn.
inline void product(const Product& p, const PassDesc& pass, float* y, int id, int threads) {
    int64_t total = 0;
    for (int64_t i = 0; i < p.parts; ++i) total += (p.rows[i] + LANES - 1) / LANES;
    int64_t begin, end;
    share(total, id, threads, &begin, &end);
    int64_t first = 0, col = 0;
    for (int64_t i = 0; i < p.parts; ++i) {
        const int64_t tiles = (p.rows[i] + LANES - 1) / LANES;
        const int64_t lo = begin > first ? begin - first : 0, hi = end - first < tiles ? end - first : tiles;
        if (lo < hi) {
            const int type = (int)p.type[i];
            const uint8_t* act = block_inputs(type) == QK_K ? pass.act_k : pass.act_0;
            FR_MATMUL(type, p.packed[i], p.in, act, pass.rows, lo, hi, p.rows[i], y + col, p.out,
                      p.bias ? p.bias + col : nullptr);
        }
        first += tiles;
        col += p.rows[i];
    }
}

constexpr int64_t SPAN = 32;   // cache slots scored together (16 KB at head_dim 128)
constexpr int64_t AHEAD = 64;  // slots weighed together; a float16 cache's rows are requested this far ahead
constexpr int64_t HALF_DIM = 256;   // the widest head a float16 cache serves (its span's floats on the stack)

inline int64_t visible(const RowDesc& row) { return row.prefix + row.n_extra; }
inline int64_t round16(int64_t n) { return (n + L - 1) / L * L; }

// The slot of a row's j-th visible position.
inline int64_t slot(const RowDesc& row, int64_t j) { return j < row.prefix ? j : row.extra[j - row.prefix]; }

// Where a row's j-th visible key (or value) lies as float32: in a float32 cache itself...
struct InCache {
    static constexpr bool half = false;
    static constexpr bool in_l1 = false;   // rows far apart in memory: read each in turn
    const float* base;
    const RowDesc& row;
    int64_t d;
    const float* operator()(int64_t j) const { return base + slot(row, j) * d; }
};

// ... or in a span of a float16 cache converted first (positions [j0, j0 + SPAN)).
struct InSpan {
    static constexpr bool half = false;
    static constexpr bool in_l1 = true;    // rows in L1: sixteen keys read side by side
    const float* buf;
    int64_t j0, d;
    const float* operator()(int64_t j) const { return buf + (j - j0) * d; }
};

// ... or in a float16 cache itself, as halves: the rows AHEAD slots on (the last row where fewer are
// left) requested early; keys widened into a span, values in registers, one read for all heads.
struct InHalf {
    static constexpr bool half = true;
    const uint16_t* base;
    const RowDesc& row;
    int64_t d, n;   // n: the row's visible positions
    const uint16_t* operator()(int64_t j) const { return base + slot(row, j) * d; }
    const uint16_t* ahead(int64_t j) const { return base + slot(row, j + AHEAD < n ? j + AHEAD : j) * d; }
};

// The cache lines of `bytes` from p requested into L2, for a read soon after.
inline void request(const void* p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char*)p + b, 0, 2);
}

// f(at, j0, j1) for each span [j0, j1) of a row's visible keys (or values) [begin, n) from `base`, `at`
// an InCache or an InSpan: a float32 cache read in place, a float16 one widened (exactly) into buf first.
template <class F>
inline void each_span(const RowDesc& row, const void* base, int64_t begin, int64_t n, int64_t d, float* buf, F f) {
    for (int64_t j0 = begin; j0 < n; j0 += SPAN) {
        const int64_t j1 = j0 + SPAN < n ? j0 + SPAN : n;
        if (row.kv_half) {
            const InHalf rows{(const uint16_t*)base, row, d, n};
            for (int64_t j = j0; j < j1; ++j) {
                request(rows.ahead(j), d * 2);
                from_half(rows(j), buf + (j - j0) * d, d);
            }
            f(InSpan{buf, j0, d}, j0, j1);
        } else {
            f(InCache{(const float*)base, row, d}, j0, j1);
        }
    }
}

// Outputs [i0, i0 + 16 C) of H heads' running sum_j p[h][j] v_j over positions [j0, j1) (fma, j in
// order), kept in registers over the span and carried in `o` from one span to the next. Each
// output's sum is a chain of dependent fmas, so H x C of them run side by side to fill the units.
// A float16 row is widened in registers, and the same columns AHEAD rows on requested.
template <int H, int C, class At>
inline void weigh(const float* p, int64_t stride, const At& at, int64_t j0, int64_t j1, int64_t d, int64_t i0,
                  float* o) {
    constexpr int W = C * L;
    float acc[H][W];
    for (int h = 0; h < H; ++h)
        for (int l = 0; l < W; ++l) acc[h][l] = j0 == 0 ? 0.0f : o[h * d + i0 + l];
    for (int64_t j = j0; j < j1; ++j) {
        const float* v;
        alignas(64) float wide[W];
        if constexpr (At::half) {
            request(at.ahead(j) + i0, W * 2);
            from_half(at(j) + i0, wide, W);
            v = wide;
        } else {
            v = at(j) + i0;
        }
        for (int h = 0; h < H; ++h) {
            const float pj = p[h * stride + j];
#pragma omp simd
            for (int l = 0; l < W; ++l) acc[h][l] = fmaf(pj, v[l], acc[h][l]);
        }
    }
    for (int h = 0; h < H; ++h)
        for (int l = 0; l < W; ++l) o[h * d + i0 + l] = acc[h][l];
}

constexpr int floor2(int n) { return n < 2 ? 1 : 2 * floor2(n / 2); }

// H heads' weighed values over [j0, j1), C x 16 outputs at a time: about WEIGH_SUMS sums side by side.
template <int H, class At>
inline void weigh_heads(const float* p, int64_t stride, const At& at, int64_t j0, int64_t j1, int64_t d, float* o) {
    constexpr int C = floor2(WEIGH_SUMS / H);
    int64_t i0 = 0;
    if ((d / L) % C == 0)
        for (; i0 < d; i0 += C * L) weigh<H, C>(p, stride, at, j0, j1, d, i0, o);
    for (; i0 < d; i0 += L) weigh<H, 1>(p, stride, at, j0, j1, d, i0, o);
}

// Every head's weighed values over [j0, j1): heads WEIGH_HEADS (or fewer) at a time.
template <class At>
inline void weigh_span(const float* p, int64_t stride, int64_t heads, const At& at, int64_t j0, int64_t j1, int64_t d,
                       float* out) {
    static_assert(WEIGH_HEADS >= 1 && WEIGH_HEADS <= 6, "weigh_span takes one to six heads at a time");
    for (int64_t h = 0; h < heads;) {
        const float* ph = p + h * stride;
        float* oh = out + h * d;
        const int64_t group = heads - h < WEIGH_HEADS ? heads - h : WEIGH_HEADS;
        switch (group) {
            case 1: weigh_heads<1>(ph, stride, at, j0, j1, d, oh); break;
            case 2: weigh_heads<2>(ph, stride, at, j0, j1, d, oh); break;
            case 3: weigh_heads<3>(ph, stride, at, j0, j1, d, oh); break;
            case 4: weigh_heads<4>(ph, stride, at, j0, j1, d, oh); break;
            case 5: weigh_heads<5>(ph, stride, at, j0, j1, d, oh); break;
            default: weigh_heads<6>(ph, stride, at, j0, j1, d, oh); break;
        }
        h += group;
    }
}

// scores[h][j] = q_h . key_j over positions [j0, j1) (they stay in L1) for the heads sharing a
// key/value head, head by head. D: the head size, or 0 for `d` at run time.
template <int D, class At>
inline void score_span(const float* __restrict q, int64_t heads, const At& at, int64_t j0, int64_t j1, int64_t stride,
                       float* __restrict scores, int64_t d) {
    const float* keys[SPAN];
    for (int64_t j = j0; j < j1; ++j) keys[j - j0] = at(j);
    for (int64_t h = 0; h < heads; ++h) {
        const float* qh = q + h * d;
        float* s = scores + h * stride;
        int64_t j = j0;
        if constexpr (At::in_l1)
            for (; j + 16 <= j1; j += 16) dots16(qh, keys + (j - j0), D ? D : d, s + j);
        for (; j < j1; ++j) s[j] = dot16(qh, keys[j - j0], D ? D : d);
    }
}

template <class At>
inline void score_any(const float* q, int64_t heads, const At& at, int64_t j0, int64_t j1, int64_t stride,
                      float* scores, int64_t d) {
    switch (d) {   // a head size known here keeps a head's query in registers over the keys
        case 64: score_span<64>(q, heads, at, j0, j1, stride, scores, d); break;
        case 128: score_span<128>(q, heads, at, j0, j1, stride, scores, d); break;
        default: score_span<0>(q, heads, at, j0, j1, stride, scores, d); break;
    }
}

// Rows [r0, r1) of a pass, all reading one cache, attended over key/value head g: for each row its
// query heads sharing g, out [heads sharing][head_dim]. The slots every row sees first (its prefix,
// the least of the rows') are read once for all of them, a span or a block at a time, then each
// row's own; each row's sums are the same as alone. A float16 cache's keys are widened a span at a
// time and its values row by row, exactly to float32, so the sums are those of a float32 cache that
// held the rounded entries. `scores`: (r1 - r0) x heads sharing x `padded` floats.
struct Rows {
    const LayerDesc& l;
    const PassDesc& pass;
    int64_t g, r0, r1, padded;   // padded: the most visible slots, rounded up to 16
    float* scores;
    int64_t share() const { return l.heads / l.kv_heads; }
    const RowDesc& row(int64_t r) const { return pass.row[r]; }
    int64_t n(int64_t r) const { return visible(pass.row[r]); }
    const float* q(int64_t r) const { return pass.qkv + r * l.qkv.out + g * share() * l.head_dim; }
    float* out(int64_t r) const { return pass.att + r * l.heads * l.head_dim + g * share() * l.head_dim; }
    float* p(int64_t r) const { return scores + (r - r0) * share() * padded; }
};

// Values [j0, j1) weighed into each of the rows' sums, from row `via`'s view of the cache.
inline void weigh_rows(const Rows& rs, const RowDesc& via, int64_t at, int64_t j0, int64_t j1, int64_t ra,
                       int64_t rb) {
    const int64_t d = rs.l.head_dim, seen = visible(via);
    for (int64_t r = ra; r < rb; ++r) {
        if (via.kv_half)
            weigh_span(rs.p(r), rs.padded, rs.share(), InHalf{(const uint16_t*)via.v + at, via, d, seen}, j0, j1, d,
                       rs.out(r));
        else
            weigh_span(rs.p(r), rs.padded, rs.share(), InCache{(const float*)via.v + at, via, d}, j0, j1, d, rs.out(r));
    }
}

inline void attend_rows(const Rows& rs, int64_t layer) {
    const LayerDesc& l = rs.l;
    const RowDesc& first = rs.row(rs.r0);
    const int64_t d = l.head_dim, share = rs.share(), at = layer * first.layer_stride + rs.g * first.slots * d;
    const size_t entry = first.kv_half ? 2 : 4;   // bytes
    int64_t common = first.prefix;
    for (int64_t r = rs.r0; r < rs.r1; ++r) common = rs.row(r).prefix < common ? rs.row(r).prefix : common;
    alignas(64) float buf[SPAN * HALF_DIM];       // a float16 cache's span, widened
    const char* keys = (const char*)first.k + at * entry;
    each_span(first, keys, 0, common, d, buf, [&](const auto& span, int64_t j0, int64_t j1) {
        for (int64_t r = rs.r0; r < rs.r1; ++r) score_any(rs.q(r), share, span, j0, j1, rs.padded, rs.p(r), d);
    });
    for (int64_t r = rs.r0; r < rs.r1; ++r) {
        each_span(rs.row(r), keys, common, rs.n(r), d, buf, [&](const auto& span, int64_t j0, int64_t j1) {
            score_any(rs.q(r), share, span, j0, j1, rs.padded, rs.p(r), d);
        });
        for (int64_t h = 0; h < share; ++h) {
            float* p = rs.p(r) + h * rs.padded;
            float peak = -INFINITY;
            const int64_t n = rs.n(r);
#pragma omp simd reduction(max : peak)
            for (int64_t j = 0; j < n; ++j) peak = p[j] > peak ? p[j] : peak;
            exp_shift(p, n, peak);
            for (int64_t j = n; j < rs.padded; ++j) p[j] = 0.0f;
        }
    }
    for (int64_t j0 = 0; j0 < common; j0 += AHEAD)   // a block of values stays in L1 over the rows
        weigh_rows(rs, first, at, j0, j0 + AHEAD < common ? j0 + AHEAD : common, rs.r0, rs.r1);
    for (int64_t r = rs.r0; r < rs.r1; ++r) {
        const int64_t n = rs.n(r);
        for (int64_t j0 = common; j0 < n; j0 += AHEAD)
            weigh_rows(rs, rs.row(r), at, j0, j0 + AHEAD < n ? j0 + AHEAD : n, r, r + 1);
        for (int64_t h = 0; h < share; ++h) {
            const float total = sum16(rs.p(r) + h * rs.padded, rs.padded);
            float* o = rs.out(r) + h * d;
            for (int64_t i = 0; i < d; ++i) o[i] = o[i] / total;
        }
    }
}

// A row's new key (rope applied) and value into its cache at its slot, rounded where it holds float16.
inline void store_entry(const RowDesc& row, int64_t at, const float* k, const float* v, int64_t d) {
    if (row.kv_half) {
        to_half(k, (uint16_t*)row.k + at, d);
        to_half(v, (uint16_t*)row.v + at, d);
    } else {
        memcpy((float*)row.k + at, k, d * sizeof(float));
        memcpy((float*)row.v + at, v, d * sizeof(float));
    }
}

// The whole layer for this thread (called by every thread of one parallel region).
inline void run_layer(const LayerDesc& l, const PassDesc& pass, int64_t layer, float* x, int id, int threads) {
    const int64_t t = pass.rows, hidden = l.hidden, d = l.head_dim, f = l.ffn;
    const int64_t q_width = l.heads * d, share_heads = l.heads / l.kv_heads;
    int64_t r0, r1, u0, u1;
    share(t, id, threads, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) rmsnorm(x + r * hidden, l.norm1, l.eps, hidden, pass.h + r * hidden);
    quantize_for(l.qkv, pass, pass.h, hidden, r0, r1);
#pragma omp barrier
    product(l.qkv, pass, pass.qkv, id, threads);
#pragma omp barrier
    share(t * l.kv_heads, id, threads, &u0, &u1);     // units: (row, key/value head)
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t r = u / l.kv_heads, g = u % l.kv_heads;
        const RowDesc& row = pass.row[r];
        float* qkv = pass.qkv + r * l.qkv.out;
        for (int64_t h = g * share_heads; h < (g + 1) * share_heads; ++h) {
            if (l.q_norm) rmsnorm(qkv + h * d, l.q_norm, l.eps, d, qkv + h * d);
            rope(qkv + h * d, row.cos, row.sin, d, l.scale);
        }
        float* k = qkv + q_width + g * d;
        const float* v = qkv + q_width + l.kv_heads * d + g * d;
        if (l.k_norm) rmsnorm(k, l.k_norm, l.eps, d, k);
        rope(k, row.cos, row.sin, d, 1.0f);
        const int64_t at = layer * row.layer_stride + g * row.slots * d + row.write * d;
        store_entry(row, at, k, v, d);
    }
#pragma omp barrier
    for (int64_t u = u0; u < u1;) {                     // every row's key and value are in place now
        const int64_t r = u % t, g = u / t;             // a head's rows together, those of one cache at once
        int64_t e = u + 1, most = visible(pass.row[r]);
        for (; e < u1 && e / t == g && pass.row[e % t].k == pass.row[r].k; ++e) {
            const int64_t seen = visible(pass.row[e % t]), wider = seen > most ? seen : most;
            if ((e - u + 1) * share_heads * round16(wider) > pass.scores_stride) break;   // what the scratch holds
            most = wider;
        }
        attend_rows(Rows{l, pass, g, r, r + (e - u), round16(most), pass.scores + id * pass.scores_stride}, layer);
        u = e;
    }
#pragma omp barrier
    quantize_for(l.o, pass, pass.att, q_width, r0, r1);
#pragma omp barrier
    product(l.o, pass, pass.tmp, id, threads);
#pragma omp barrier
    for (int64_t r = r0; r < r1; ++r) {
        float* xr = x + r * hidden;
        const float* add = pass.tmp + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) xr[i] += add[i];
        rmsnorm(xr, l.norm2, l.eps, hidden, pass.h + r * hidden);
    }
    quantize_for(l.gate_up, pass, pass.h, hidden, r0, r1);
#pragma omp barrier
    product(l.gate_up, pass, pass.gu, id, threads);
#pragma omp barrier
    share(t * f / L, id, threads, &u0, &u1);            // units: 16 columns of the gate half
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t r = u * L / f, c0 = u * L % f;
        float* gate = pass.gu + r * l.gate_up.out + c0;
        silu_mul(gate, gate + f, L);
    }
#pragma omp barrier
    quantize_for(l.down, pass, pass.gu, l.gate_up.out, r0, r1);
#pragma omp barrier
    product(l.down, pass, pass.tmp, id, threads);
#pragma omp barrier
    for (int64_t r = r0; r < r1; ++r) {
        float* xr = x + r * hidden;
        const float* add = pass.tmp + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) xr[i] += add[i];
    }
}

// The final norm and the head over rows [0, pass.rows) of x (row stride ldx): each row normalised as
// the layers' norms into h [rows, head.in] and quantized (this thread's rows), then this thread's
// share of the head's output tiles into y [rows, head.out]: fr_rmsnorm's rows and fr_matmul's sums.
inline void run_norm_head(const Product& head, const float* gain, float eps, const PassDesc& pass, const float* x,
                          int64_t ldx, float* h, float* y, int id, int threads) {
    int64_t r0, r1;
    share(pass.rows, id, threads, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) rmsnorm(x + r * ldx, gain, eps, head.in, h + r * head.in);
    quantize_for(head, pass, h, head.in, r0, r1);
#pragma omp barrier
    product(head, pass, y, id, threads);
}


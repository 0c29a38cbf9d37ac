// Split-T (flash-decoding) absorbed MLA attention, f32 SIMT arithmetic: the exact kernel.
//
// grid = (n_splits, n_items, ceil(H / 8)), block = 256 threads (8 warps, one head per warp).
// CTA (j, i, g) attends positions [j*split_rows, (j+1)*split_rows) of item i's `length` rows with
// heads g*8 .. g*8+7 and writes an un-normalised partial (acc, running max m, normaliser l);
// mla_reduce.cu merges the partials. Rows are staged tile by tile into shared memory, decoded
// (fp8: table value; int4: Lloyd-Max level of each nibble) with the row factor kept apart and
// hoisted out of the dots, as the engine does.
//   score_t = (Lsc_t * (qabs . Lc_t) + Rsc_t * (qrope . Rc_t)) * scale
//   acc     = sum_t exp(score_t - m) * Lsc_t * Lc_t ,  l = sum_t exp(score_t - m)
// Row kinds: f32 rows (factors 1); fp8 codes + scales; v3 rows, read as unit-scale ROTATED-domain
// values: int4 (tag 0x104, factor radius / sqrtf(width)) and PolarQuant (tag = bits, factor radius,
// the angle tree of mla_polar.cuh); the host rotates the queries before and unrotates the context
// after (mla_rotate.cu). `tables`: int4 the 16 levels; PolarQuant cos | sin of Lc, then of Rc.
// Dense entries (mla_split_simt_*) attend rows 0 .. length-1 of the session; sparse entries
// (mla_sparse_simt_*) attend rows sel[i * sel_stride + p], p < length (DSA: the selected rows,
// read by index in place, no gathered copy).
#include "mla_common.cuh"
#include "mla_polar.cuh"

#define SIMT_WARPS 8
#define SIMT_TILE 16
#define SIMT_KV_PER ((MLA_KV + 31) / 32)
#define SIMT_ROPE_PER ((MLA_ROPE + 31) / 32)

enum { MLA_F32 = 0, MLA_FP8 = 1, MLA_INT4 = 2, MLA_POLAR = 3 };

// Element d of a cache row as the tile holds it (before the row factor).
template <int KIND>
MLA_DEVICE float mla_element(const mla_u8* row, int d, const float* levels_s) {
    if (KIND == MLA_FP8) return mla_fp8_decode(row[d]);
    if (KIND == MLA_INT4) return levels_s[(row[d >> 1] >> ((d & 1) * 4)) & 15u];  // even element: low nibble
    return ((const float*)row)[d];
}

// The hoisted factor of a row: 1 (f32), the sanitised fp8 scale or PolarQuant radius, or the int4 std
// (radius / sqrtf(width)).
template <int KIND>
MLA_DEVICE float mla_row_factor(const mla_u8* p, float sqrt_width) {
    if (KIND == MLA_F32) return 1.0f;
    const float v = mla_sanitize_scale(*(const float*)p);
    return KIND == MLA_INT4 ? v / sqrt_width : v;
}

// Stage tile positions [p0, p0 + n) into shared memory; position p is row `sel ? sel[p] : p`.
template <int KIND>
MLA_DEVICE void mla_stage_tile(const MlaSession& s, const int* sel, int p0, int n, float (*lc_s)[MLA_KV],
                               float (*rc_s)[MLA_ROPE], float* lsc_s, float* rsc_s, const float* tables_s,
                               int bits) {
    const int tid = threadIdx.x;
    if (KIND == MLA_POLAR) {
        const int kl = mla_polar_entries(MLA_KV, bits), kr = mla_polar_entries(MLA_ROPE, bits);
        mla_polar_tile<MLA_KV, SIMT_TILE>(s.lc, s.lc_stride, sel, p0, n, lc_s, tables_s, tables_s + kl, bits);
        mla_polar_tile<MLA_ROPE, SIMT_TILE>(s.rc, s.rc_stride, sel, p0, n, rc_s, tables_s + 2 * kl,
                                            tables_s + 2 * kl + kr, bits);
    } else {
        for (int idx = tid; idx < SIMT_TILE * MLA_KV; idx += blockDim.x) {
            int t = idx / MLA_KV, d = idx % MLA_KV;
            float v = 0.0f;
            if (t < n) v = mla_element<KIND>(mla_row(s.lc, s.lc_stride, sel ? sel[p0 + t] : p0 + t), d, tables_s);
            lc_s[t][d] = v;
        }
        for (int idx = tid; idx < SIMT_TILE * MLA_ROPE; idx += blockDim.x) {
            int t = idx / MLA_ROPE, d = idx % MLA_ROPE;
            float v = 0.0f;
            if (t < n) v = mla_element<KIND>(mla_row(s.rc, s.rc_stride, sel ? sel[p0 + t] : p0 + t), d, tables_s);
            rc_s[t][d] = v;
        }
    }
    if (tid < SIMT_TILE) {
        float ls = 1.0f, rs = 1.0f;
        if (tid < n) {
            const int r = sel ? sel[p0 + tid] : p0 + tid;
            ls = mla_row_factor<KIND>(mla_row(s.lsc, s.lsc_stride, r), sqrtf((float)MLA_KV));
            rs = mla_row_factor<KIND>(mla_row(s.rsc, s.rsc_stride, r), sqrtf((float)MLA_ROPE));
        }
        lsc_s[tid] = ls;
        rsc_s[tid] = rs;
    }
}

template <int KIND>
MLA_DEVICE void mla_split_simt(const MlaSession* sessions, const MlaItem* items, const float* q_abs,
                               const float* q_rope, float* part_o, float* part_ml, float scale, int split_rows,
                               int n_splits, const float* tables, const int* sel_all, int sel_stride, int bits) {
    __shared__ float lc_s[SIMT_TILE][MLA_KV];
    __shared__ float rc_s[SIMT_TILE][MLA_ROPE];
    __shared__ float lsc_s[SIMT_TILE];
    __shared__ float rsc_s[SIMT_TILE];
    __shared__ float tables_s[KIND == MLA_POLAR ? MLA_POLAR_TABLES : 16];

    const int split = blockIdx.x, item_ix = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int head = blockIdx.z * SIMT_WARPS + warp;
    const bool live = head < MLA_HEADS;  // idle warps still reach every barrier
    const MlaItem item = items[item_ix];
    const int row0 = split * split_rows;
    if (row0 >= item.length) return;  // whole CTA: uniform, no barrier skipped by a subset
    const int row1 = min(row0 + split_rows, item.length);
    const MlaSession sess = sessions[item.session];
    const int* sel = sel_all ? sel_all + (mla_i64)item_ix * sel_stride : nullptr;
    const int n_tables = KIND == MLA_POLAR ? 2 * (mla_polar_entries(MLA_KV, bits) + mla_polar_entries(MLA_ROPE, bits))
                                           : KIND == MLA_INT4 ? 16 : 0;
    for (int i = threadIdx.x; i < n_tables; i += blockDim.x) tables_s[i] = tables[i];  // read after a barrier

    float qa[SIMT_KV_PER], qr[SIMT_ROPE_PER], acc[SIMT_KV_PER];
    const float* qa_row = q_abs + ((mla_i64)item.q_row * MLA_HEADS + (live ? head : 0)) * MLA_KV;
    const float* qr_row = q_rope + ((mla_i64)item.q_row * MLA_HEADS + (live ? head : 0)) * MLA_ROPE;
#pragma unroll
    for (int k = 0; k < SIMT_KV_PER; ++k) {
        int d = lane + 32 * k;
        qa[k] = d < MLA_KV ? qa_row[d] : 0.0f;
        acc[k] = 0.0f;
    }
#pragma unroll
    for (int k = 0; k < SIMT_ROPE_PER; ++k) {
        int d = lane + 32 * k;
        qr[k] = d < MLA_ROPE ? qr_row[d] : 0.0f;
    }
    float m = MLA_NEG_INF, l = 0.0f;

    for (int r0 = row0; r0 < row1; r0 += SIMT_TILE) {
        const int n = min(SIMT_TILE, row1 - r0);
        __syncthreads();  // previous tile fully consumed
        mla_stage_tile<KIND>(sess, sel, r0, n, lc_s, rc_s, lsc_s, rsc_s, tables_s, bits);
        __syncthreads();
        float sc[SIMT_TILE];
        float tile_max = MLA_NEG_INF;
#pragma unroll
        for (int t = 0; t < SIMT_TILE; ++t) {
            float pl = 0.0f, pr = 0.0f;
#pragma unroll
            for (int k = 0; k < SIMT_KV_PER; ++k) {
                int d = lane + 32 * k;
                if (d < MLA_KV) pl += qa[k] * lc_s[t][d];
            }
#pragma unroll
            for (int k = 0; k < SIMT_ROPE_PER; ++k) {
                int d = lane + 32 * k;
                if (d < MLA_ROPE) pr += qr[k] * rc_s[t][d];
            }
            pl = mla_warp_sum(pl);
            pr = mla_warp_sum(pr);
            sc[t] = t < n ? (lsc_s[t] * pl + rsc_s[t] * pr) * scale : MLA_NEG_INF;
            tile_max = fmaxf(tile_max, sc[t]);
        }
        const float m_new = fmaxf(m, tile_max);
        const float corr = expf(m - m_new);  // 0 on the first tile (m = -inf)
        float psum = 0.0f;
#pragma unroll
        for (int k = 0; k < SIMT_KV_PER; ++k) acc[k] *= corr;
#pragma unroll
        for (int t = 0; t < SIMT_TILE; ++t) {
            float p = t < n ? expf(sc[t] - m_new) : 0.0f;
            psum += p;
            float w = p * lsc_s[t];
#pragma unroll
            for (int k = 0; k < SIMT_KV_PER; ++k) {
                int d = lane + 32 * k;
                if (d < MLA_KV) acc[k] += w * lc_s[t][d];
            }
        }
        l = l * corr + psum;
        m = m_new;
    }
    if (!live) return;
    const mla_i64 part = ((mla_i64)item_ix * n_splits + split) * MLA_HEADS + head;
#pragma unroll
    for (int k = 0; k < SIMT_KV_PER; ++k) {
        int d = lane + 32 * k;
        if (d < MLA_KV) part_o[part * MLA_KV + d] = acc[k];
    }
    if (lane == 0) {
        part_ml[part * 2] = m;
        part_ml[part * 2 + 1] = l;
    }
}

MLA_KERNEL void mla_split_simt_fp8(const MlaSession* sessions, const MlaItem* items, const float* q_abs,
                                   const float* q_rope, float* part_o, float* part_ml, float scale,
                                   int split_rows, int n_splits) {
    mla_split_simt<MLA_FP8>(sessions, items, q_abs, q_rope, part_o, part_ml, scale, split_rows, n_splits,
                            nullptr, nullptr, 0, 0);
}

MLA_KERNEL void mla_split_simt_f32(const MlaSession* sessions, const MlaItem* items, const float* q_abs,
                                   const float* q_rope, float* part_o, float* part_ml, float scale,
                                   int split_rows, int n_splits) {
    mla_split_simt<MLA_F32>(sessions, items, q_abs, q_rope, part_o, part_ml, scale, split_rows, n_splits,
                            nullptr, nullptr, 0, 0);
}

MLA_KERNEL void mla_split_simt_int4(const MlaSession* sessions, const MlaItem* items, const float* q_abs,
                                   const float* q_rope, float* part_o, float* part_ml, float scale,
                                   int split_rows, int n_splits, const float* levels) {
    mla_split_simt<MLA_INT4>(sessions, items, q_abs, q_rope, part_o, part_ml, scale, split_rows, n_splits,
                            levels, nullptr, 0, 0);
}

MLA_KERNEL void mla_split_simt_polar(const MlaSession* sessions, const MlaItem* items, const float* q_abs,
                                   const float* q_rope, float* part_o, float* part_ml, float scale,
                                   int split_rows, int n_splits, const float* tables, int bits) {
    mla_split_simt<MLA_POLAR>(sessions, items, q_abs, q_rope, part_o, part_ml, scale, split_rows, n_splits,
                             tables, nullptr, 0, bits);
}

// Sparse (DSA) entries: item i attends rows sel[i * sel_stride + p], p < items[i].length.
MLA_KERNEL void mla_sparse_simt_f32(const MlaSession* sessions, const MlaItem* items, const float* q_abs,
                                   const float* q_rope, float* part_o, float* part_ml, float scale,
                                   int split_rows, int n_splits, const float* levels, const int* sel,
                                    int sel_stride) {
    mla_split_simt<MLA_F32>(sessions, items, q_abs, q_rope, part_o, part_ml, scale, split_rows, n_splits,
                            levels, sel, sel_stride, 0);
}

MLA_KERNEL void mla_sparse_simt_fp8(const MlaSession* sessions, const MlaItem* items, const float* q_abs,
                                   const float* q_rope, float* part_o, float* part_ml, float scale,
                                   int split_rows, int n_splits, const float* levels, const int* sel,
                                    int sel_stride) {
    mla_split_simt<MLA_FP8>(sessions, items, q_abs, q_rope, part_o, part_ml, scale, split_rows, n_splits,
                            levels, sel, sel_stride, 0);
}

MLA_KERNEL void mla_sparse_simt_int4(const MlaSession* sessions, const MlaItem* items, const float* q_abs,
                                   const float* q_rope, float* part_o, float* part_ml, float scale,
                                   int split_rows, int n_splits, const float* levels, const int* sel,
                                    int sel_stride) {
    mla_split_simt<MLA_INT4>(sessions, items, q_abs, q_rope, part_o, part_ml, scale, split_rows, n_splits,
                            levels, sel, sel_stride, 0);
}

MLA_KERNEL void mla_sparse_simt_polar(const MlaSession* sessions, const MlaItem* items, const float* q_abs,
                                   const float* q_rope, float* part_o, float* part_ml, float scale,
                                   int split_rows, int n_splits, const float* tables, const int* sel,
                                     int sel_stride, int bits) {
    mla_split_simt<MLA_POLAR>(sessions, items, q_abs, q_rope, part_o, part_ml, scale, split_rows, n_splits,
                             tables, sel, sel_stride, bits);
}

// Split-T (flash-decoding) absorbed MLA attention, f32 SIMT arithmetic: the exact kernel.
//
// grid = (n_splits, n_items, ceil(H / 8)), block = 256 threads (8 warps, one head per warp).
// CTA (j, i, g) attends rows [j*split_rows, (j+1)*split_rows) of item i's visible rows with
// heads g*8 .. g*8+7 and writes an un-normalised partial (acc, running max m, normaliser l);
// mla_reduce.cu merges the partials. Rows are staged tile by tile into shared memory, decoded
// (fp8: table value, scale kept apart and hoisted out of the dots, as the engine does).
//   score_t = (Lsc_t * (qabs . Lc_t) + Rsc_t * (qrope . Rc_t)) * scale
//   acc     = sum_t exp(score_t - m) * Lsc_t * Lc_t ,  l = sum_t exp(score_t - m)
#include "mla_common.cuh"

#define SIMT_WARPS 8
#define SIMT_TILE 16
#define SIMT_KV_PER ((MLA_KV + 31) / 32)
#define SIMT_ROPE_PER ((MLA_ROPE + 31) / 32)

template <bool FP8>
MLA_DEVICE void mla_stage_tile(const MlaSession& s, int r0, int n, float (*lc_s)[MLA_KV], float (*rc_s)[MLA_ROPE],
                               float* lsc_s, float* rsc_s) {
    const int tid = threadIdx.x;
    for (int idx = tid; idx < SIMT_TILE * MLA_KV; idx += blockDim.x) {
        int t = idx / MLA_KV, d = idx % MLA_KV;
        float v = 0.0f;
        if (t < n) {
            const mla_u8* row = mla_row(s.lc, s.lc_stride, r0 + t);
            v = FP8 ? mla_fp8_decode(row[d]) : ((const float*)row)[d];
        }
        lc_s[t][d] = v;
    }
    for (int idx = tid; idx < SIMT_TILE * MLA_ROPE; idx += blockDim.x) {
        int t = idx / MLA_ROPE, d = idx % MLA_ROPE;
        float v = 0.0f;
        if (t < n) {
            const mla_u8* row = mla_row(s.rc, s.rc_stride, r0 + t);
            v = FP8 ? mla_fp8_decode(row[d]) : ((const float*)row)[d];
        }
        rc_s[t][d] = v;
    }
    if (tid < SIMT_TILE) {
        float ls = 1.0f, rs = 1.0f;
        if (FP8 && tid < n) {
            ls = mla_sanitize_scale(*(const float*)mla_row(s.lsc, s.lsc_stride, r0 + tid));
            rs = mla_sanitize_scale(*(const float*)mla_row(s.rsc, s.rsc_stride, r0 + tid));
        }
        lsc_s[tid] = ls;
        rsc_s[tid] = rs;
    }
}

template <bool FP8>
MLA_DEVICE void mla_split_simt(const MlaSession* sessions, const MlaItem* items, const float* q_abs,
                               const float* q_rope, float* part_o, float* part_ml, float scale, int split_rows,
                               int n_splits) {
    __shared__ float lc_s[SIMT_TILE][MLA_KV];
    __shared__ float rc_s[SIMT_TILE][MLA_ROPE];
    __shared__ float lsc_s[SIMT_TILE];
    __shared__ float rsc_s[SIMT_TILE];

    const int split = blockIdx.x, item_ix = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int head = blockIdx.z * SIMT_WARPS + warp;
    const bool live = head < MLA_HEADS;  // idle warps still reach every barrier
    const MlaItem item = items[item_ix];
    const int row0 = split * split_rows;
    if (row0 >= item.length) return;  // whole CTA: uniform, no barrier skipped by a subset
    const int row1 = min(row0 + split_rows, item.length);
    const MlaSession sess = sessions[item.session];

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
        mla_stage_tile<FP8>(sess, r0, n, lc_s, rc_s, lsc_s, rsc_s);
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
    mla_split_simt<true>(sessions, items, q_abs, q_rope, part_o, part_ml, scale, split_rows, n_splits);
}

MLA_KERNEL void mla_split_simt_f32(const MlaSession* sessions, const MlaItem* items, const float* q_abs,
                                   const float* q_rope, float* part_o, float* part_ml, float scale,
                                   int split_rows, int n_splits) {
    mla_split_simt<false>(sessions, items, q_abs, q_rope, part_o, part_ml, scale, split_rows, n_splits);
}

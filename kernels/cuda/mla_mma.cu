// Split-T absorbed MLA attention over fp8 rows on tensor cores (mma.sync m16n8k16, f16 in, f32 acc).
//
// grid = (n_splits, n_items, ceil(H / 32)), block = 256 threads (8 warps, MMA_THREADS), dynamic shared memory
// (mla_mma_smem_bytes below; the loader raises the opt-in limit). Same partials as mla_simt.cu.
//
// Exactness: every e4m3 value is exact in f16. Staged as f16(table[code] / 256) (a bit shuffle of the
// code, no table), so K and V are exact and the 256 is folded back into the scores and the output.
// q is scaled per CTA by a power of two and split q = hi + lo (two f16), P' = p * Lsc / Lsc_max is
// split the same way: the "exact" kernel issues both halves (about 22 significant bits, f32-like),
// the "fast" kernel only hi (11 bits: relative error ~ 2^-11 per operand, well below the fp8 rounding
// of the cache itself, 2^-4).
//
// Warp roles per tile of 32 rows: scores: warp w -> heads (w/4)*16.., rows (w%4)*8..; softmax: thread
// -> (head tid/8, 4 rows); P.V: warp w -> heads (w/4)*16.., dims (w%4)*KV/4...
#include "mla_common.cuh"

#define MMA_HG 32
#define MMA_TILE 32
#define MMA_D (MLA_KV + MLA_ROPE)
#define MMA_QS (MMA_D + 8)      // f16 row stride of q and k tiles (conflict-free fragment loads)
#define MMA_PS (MMA_TILE + 8)   // f16 row stride of P
#define MMA_SS (MMA_TILE + 1)   // f32 row stride of scores
#define MMA_DIMS_PER_WARP (MLA_KV / 4)
#define MMA_NT (MMA_DIMS_PER_WARP / 8)

#if (MLA_KV % 32) != 0 || (MLA_ROPE % 16) != 0
#error "the mma kernel needs kv_lora % 32 == 0 and rope % 16 == 0"
#endif

// Shared-memory layout (bytes), identical for both variants except the lo halves.
template <bool EXACT>
struct MmaSmem {
    static constexpr int q_half = MMA_HG * MMA_QS * 2;
    static constexpr int q_hi = 0;
    static constexpr int q_lo = q_hi + q_half;
    static constexpr int k = q_lo + (EXACT ? q_half : 0);
    static constexpr int s = k + MMA_TILE * MMA_QS * 2;
    static constexpr int p_hi = s + MMA_HG * MMA_SS * 4;
    static constexpr int p_lo = p_hi + MMA_HG * MMA_PS * 2;
    static constexpr int lsc = p_lo + (EXACT ? MMA_HG * MMA_PS * 2 : 0);
    static constexpr int rsc = lsc + MMA_TILE * 4;
    static constexpr int m = rsc + MMA_TILE * 4;
    static constexpr int l = m + MMA_HG * 4;
    static constexpr int corr = l + MMA_HG * 4;
    static constexpr int red = corr + MMA_HG * 4;
    static constexpr int bytes = red + 16 * 4;
};

MLA_KERNEL void mla_mma_smem_bytes(int* out) {  // lets the host read the layout size it must reserve
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = MmaSmem<true>::bytes;
        out[1] = MmaSmem<false>::bytes;
    }
}

// One code -> f16 bits of table[code] / 256 (NaN codes -> 0): sign to bit 15, E/M to bits 13..7.
MLA_DEVICE mla_u32 mla_code_to_half256(mla_u32 b) {
    b &= 0xFFu;
    if ((b & 0x7Fu) == 0x7Fu) return 0u;
    return ((b & 0x7Fu) << 7) | ((b & 0x80u) << 8);
}

MLA_DEVICE mla_u32 mla_pack2(mla_u32 lo, mla_u32 hi) { return (lo & 0xFFFFu) | (hi << 16); }

// Staging is split in two so the next tile's global loads are in flight while this tile computes:
// mla_mma_load reads rows [r0, r0+n) (4 codes per 32-bit load; the host guarantees 4-byte aligned
// rows) into registers, mla_mma_store converts them into k[t][0..KV) = Lc, k[t][KV..D) = Rc as
// f16(table/256) and writes the sanitised scales. Rows >= n are zero (their scores are masked).
#define MMA_THREADS 256
#define MMA_WORDS (MMA_D / 4)
#define MMA_STAGE_ITERS ((MMA_TILE * MMA_WORDS + MMA_THREADS - 1) / MMA_THREADS)

struct MmaStage {
    mla_u32 codes[MMA_STAGE_ITERS];
    float lsc, rsc;
};

MLA_DEVICE void mla_mma_load(const MlaSession& s, int r0, int n, MmaStage& st) {
#pragma unroll
    for (int it = 0; it < MMA_STAGE_ITERS; ++it) {
        const int idx = threadIdx.x + it * MMA_THREADS, t = idx / MMA_WORDS, w = idx % MMA_WORDS;
        mla_u32 codes = 0;
        if (idx < MMA_TILE * MMA_WORDS && t < n) {
            codes = w < MLA_KV / 4 ? ((const mla_u32*)mla_row(s.lc, s.lc_stride, r0 + t))[w]
                                   : ((const mla_u32*)mla_row(s.rc, s.rc_stride, r0 + t))[w - MLA_KV / 4];
        }
        st.codes[it] = codes;
    }
    const int t = threadIdx.x;
    st.lsc = (t < MMA_TILE && t < n) ? mla_sanitize_scale(*(const float*)mla_row(s.lsc, s.lsc_stride, r0 + t)) : 0.0f;
    st.rsc = (t < MMA_TILE && t < n) ? mla_sanitize_scale(*(const float*)mla_row(s.rsc, s.rsc_stride, r0 + t)) : 0.0f;
}

MLA_DEVICE void mla_mma_store(const MmaStage& st, mla_u16* k, float* lsc, float* rsc) {
#pragma unroll
    for (int it = 0; it < MMA_STAGE_ITERS; ++it) {
        const int idx = threadIdx.x + it * MMA_THREADS, t = idx / MMA_WORDS, w = idx % MMA_WORDS;
        if (idx < MMA_TILE * MMA_WORDS) {
            const mla_u32 codes = st.codes[it];
            mla_u32* dst = (mla_u32*)(k + t * MMA_QS + 4 * w);
            dst[0] = mla_pack2(mla_code_to_half256(codes), mla_code_to_half256(codes >> 8));
            dst[1] = mla_pack2(mla_code_to_half256(codes >> 16), mla_code_to_half256(codes >> 24));
        }
    }
    if (threadIdx.x < MMA_TILE) {
        lsc[threadIdx.x] = st.lsc;
        rsc[threadIdx.x] = st.rsc;
    }
}

// q rows of this CTA's heads -> hi/lo f16 in shared memory, scaled by 2^shift; returns 2^-shift.
template <bool EXACT>
MLA_DEVICE float mla_mma_stage_q(const float* q_abs, const float* q_rope, int q_row, int head0, mla_u16* q_hi,
                                 mla_u16* q_lo, float* red) {
    float big = 0.0f;
    for (int idx = threadIdx.x; idx < MMA_HG * MMA_D; idx += blockDim.x) {
        const int hl = idx / MMA_D, d = idx % MMA_D, h = head0 + hl;
        if (h < MLA_HEADS) {
            const mla_i64 r = (mla_i64)q_row * MLA_HEADS + h;
            big = fmaxf(big, fabsf(d < MLA_KV ? q_abs[r * MLA_KV + d] : q_rope[r * MLA_ROPE + d - MLA_KV]));
        }
    }
    big = mla_warp_max(big);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = big;
    __syncthreads();
    big = red[0];
    for (int w = 1; w < (int)(blockDim.x / 32); ++w) big = fmaxf(big, red[w]);
    // 2^e <= big < 2^(e+1); scale so that max |q'| < 2^14 (f16 max is 65504)
    int e = (int)((__float_as_uint(big) >> 23) & 0xFFu) - 127;
    e = max(-100, min(100, e));
    const float mul = __uint_as_float((mla_u32)(13 - e + 127) << 23);
    const float inv = __uint_as_float((mla_u32)(e - 13 + 127) << 23);
    for (int idx = threadIdx.x; idx < MMA_HG * MMA_D; idx += blockDim.x) {
        const int hl = idx / MMA_D, d = idx % MMA_D, h = head0 + hl;
        float v = 0.0f;
        if (h < MLA_HEADS) {
            const mla_i64 r = (mla_i64)q_row * MLA_HEADS + h;
            v = (d < MLA_KV ? q_abs[r * MLA_KV + d] : q_rope[r * MLA_ROPE + d - MLA_KV]) * mul;
        }
        const mla_u16 hi = mla_f32_to_f16(v);
        q_hi[hl * MMA_QS + d] = hi;
        if (EXACT) q_lo[hl * MMA_QS + d] = mla_f32_to_f16(v - mla_f16_to_f32(hi));
    }
    return inv;
}

MLA_DEVICE void mla_load_a(mla_u32* a, const mla_u16* base, int stride, int row0, int k0) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    a[0] = *(const mla_u32*)(base + (row0 + g) * stride + k0 + 2 * t);
    a[1] = *(const mla_u32*)(base + (row0 + g + 8) * stride + k0 + 2 * t);
    a[2] = *(const mla_u32*)(base + (row0 + g) * stride + k0 + 2 * t + 8);
    a[3] = *(const mla_u32*)(base + (row0 + g + 8) * stride + k0 + 2 * t + 8);
}

template <bool EXACT>
MLA_DEVICE void mla_split_mma(const MlaSession* sessions, const MlaItem* items, const float* lsc_max,
                              const float* q_abs, const float* q_rope, float* part_o, float* part_ml, float scale,
                              int split_rows, int n_splits) {
    MLA_DYNAMIC_SMEM(smem);
    typedef MmaSmem<EXACT> L;
    mla_u16* q_hi = (mla_u16*)(smem + L::q_hi);
    mla_u16* q_lo = (mla_u16*)(smem + L::q_lo);
    mla_u16* k_s = (mla_u16*)(smem + L::k);
    float* s_s = (float*)(smem + L::s);
    mla_u16* p_hi = (mla_u16*)(smem + L::p_hi);
    mla_u16* p_lo = (mla_u16*)(smem + L::p_lo);
    float* lsc_s = (float*)(smem + L::lsc);
    float* rsc_s = (float*)(smem + L::rsc);
    float* m_s = (float*)(smem + L::m);
    float* l_s = (float*)(smem + L::l);
    float* corr_s = (float*)(smem + L::corr);
    float* red_s = (float*)(smem + L::red);

    const int split = blockIdx.x, item_ix = blockIdx.y, head0 = blockIdx.z * MMA_HG;
    const MlaItem item = items[item_ix];
    const int row0 = split * split_rows;
    if (row0 >= item.length) return;  // uniform over the CTA
    const int row1 = min(row0 + split_rows, item.length);
    const MlaSession sess = sessions[item.session];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    const int mw = warp / 4, nw = warp % 4;  // score roles; P.V: mw and dim quarter nw
    const float vscale = lsc_max[item.session] > 0.0f ? lsc_max[item.session] : 1.0f;
    const float p_norm = 1.0f / vscale;

    const float q_inv = mla_mma_stage_q<EXACT>(q_abs, q_rope, item.q_row, head0, q_hi, q_lo, red_s);
    const float score_mul = scale * 256.0f * q_inv;
    if (threadIdx.x < MMA_HG) {
        m_s[threadIdx.x] = MLA_NEG_INF;
        l_s[threadIdx.x] = 0.0f;
    }
    float acc[MMA_NT][4];
#pragma unroll
    for (int j = 0; j < MMA_NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

    MmaStage stage;
    mla_mma_load(sess, row0, min(MMA_TILE, row1 - row0), stage);
    for (int r0 = row0; r0 < row1; r0 += MMA_TILE) {
        const int n = min(MMA_TILE, row1 - r0);
        __syncthreads();  // q staged / previous tile consumed
        mla_mma_store(stage, k_s, lsc_s, rsc_s);
        __syncthreads();
        if (r0 + MMA_TILE < row1) mla_mma_load(sess, r0 + MMA_TILE, min(MMA_TILE, row1 - r0 - MMA_TILE), stage);
        {  // scores: heads mw*16.., rows nw*8..
            float cl[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cr[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mla_u32 a[4], b[2];
            const mla_u16* krow = k_s + (nw * 8 + g) * MMA_QS + 2 * t4;
            for (int k0 = 0; k0 < MLA_KV; k0 += 16) {  // Lc part of the dot products
                b[0] = *(const mla_u32*)(krow + k0);
                b[1] = *(const mla_u32*)(krow + k0 + 8);
                mla_load_a(a, q_hi, MMA_QS, mw * 16, k0);
                mla_mma(cl, a, b);
                if (EXACT) {
                    mla_load_a(a, q_lo, MMA_QS, mw * 16, k0);
                    mla_mma(cl, a, b);
                }
            }
            for (int k0 = MLA_KV; k0 < MMA_D; k0 += 16) {  // Rc part (its own scale)
                b[0] = *(const mla_u32*)(krow + k0);
                b[1] = *(const mla_u32*)(krow + k0 + 8);
                mla_load_a(a, q_hi, MMA_QS, mw * 16, k0);
                mla_mma(cr, a, b);
                if (EXACT) {
                    mla_load_a(a, q_lo, MMA_QS, mw * 16, k0);
                    mla_mma(cr, a, b);
                }
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int hl = mw * 16 + g + 8 * (i / 2), row = nw * 8 + 2 * t4 + (i & 1);
                s_s[hl * MMA_SS + row] =
                    row < n ? (lsc_s[row] * cl[i] + rsc_s[row] * cr[i]) * score_mul : MLA_NEG_INF;
            }
        }
        __syncthreads();
        {  // online softmax: thread -> head tid/8, rows (tid%8)*4 .. +4
            const int hl = threadIdx.x / 8, c0 = (threadIdx.x % 8) * 4;
            float sv[4], tmax = MLA_NEG_INF;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                sv[i] = s_s[hl * MMA_SS + c0 + i];
                tmax = fmaxf(tmax, sv[i]);
            }
            for (int off = 1; off < 8; off <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
            const float m_old = m_s[hl];
            const float m_new = fmaxf(m_old, tmax);  // finite: row 0 of every tile is visible
            float psum = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float p = expf(sv[i] - m_new);
                psum += p;
                const float pw = p * lsc_s[c0 + i] * p_norm;  // in [0, 1]
                const mla_u16 hi = mla_f32_to_f16(pw);
                p_hi[hl * MMA_PS + c0 + i] = hi;
                if (EXACT) p_lo[hl * MMA_PS + c0 + i] = mla_f32_to_f16(pw - mla_f16_to_f32(hi));
            }
            for (int off = 1; off < 8; off <<= 1) psum += __shfl_xor_sync(0xffffffffu, psum, off);
            __syncwarp();
            if (threadIdx.x % 8 == 0) {
                const float corr = expf(m_old - m_new);
                corr_s[hl] = corr;
                l_s[hl] = l_s[hl] * corr + psum;
                m_s[hl] = m_new;
            }
        }
        __syncthreads();
        {  // P.V: heads mw*16.., dims nw*KV/4 ..
            const float c_lo = corr_s[mw * 16 + g], c_hi = corr_s[mw * 16 + g + 8];
#pragma unroll
            for (int j = 0; j < MMA_NT; ++j) {
                acc[j][0] *= c_lo;
                acc[j][1] *= c_lo;
                acc[j][2] *= c_hi;
                acc[j][3] *= c_hi;
            }
            for (int k0 = 0; k0 < MMA_TILE; k0 += 16) {
                mla_u32 ah[4], al[4], b[2];
                mla_load_a(ah, p_hi, MMA_PS, mw * 16, k0);
                if (EXACT) mla_load_a(al, p_lo, MMA_PS, mw * 16, k0);
                const mla_u16* r_a = k_s + (k0 + 2 * t4) * MMA_QS;  // rows k0+2t, +1, +8, +9 of the tile
#pragma unroll
                for (int j = 0; j < MMA_NT; ++j) {
                    const int dim = nw * MMA_DIMS_PER_WARP + j * 8 + g;
                    b[0] = mla_pack2(r_a[dim], r_a[MMA_QS + dim]);
                    b[1] = mla_pack2(r_a[8 * MMA_QS + dim], r_a[9 * MMA_QS + dim]);
                    mla_mma(acc[j], ah, b);
                    if (EXACT) mla_mma(acc[j], al, b);
                }
            }
        }
    }
    __syncthreads();  // m_s / l_s final
    const float out_mul = 256.0f * vscale;
    const mla_i64 part0 = ((mla_i64)item_ix * n_splits + split) * MLA_HEADS;
#pragma unroll
    for (int j = 0; j < MMA_NT; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int h = head0 + mw * 16 + g + 8 * (i / 2);
            const int dim = nw * MMA_DIMS_PER_WARP + j * 8 + 2 * t4 + (i & 1);
            if (h < MLA_HEADS) part_o[(part0 + h) * MLA_KV + dim] = acc[j][i] * out_mul;
        }
    }
    if (threadIdx.x < MMA_HG && head0 + (int)threadIdx.x < MLA_HEADS) {
        part_ml[(part0 + head0 + threadIdx.x) * 2] = m_s[threadIdx.x];
        part_ml[(part0 + head0 + threadIdx.x) * 2 + 1] = l_s[threadIdx.x];
    }
}

MLA_KERNEL void mla_split_mma_exact(const MlaSession* sessions, const MlaItem* items, const float* lsc_max,
                                    const float* q_abs, const float* q_rope, float* part_o, float* part_ml,
                                    float scale, int split_rows, int n_splits) {
    mla_split_mma<true>(sessions, items, lsc_max, q_abs, q_rope, part_o, part_ml, scale, split_rows, n_splits);
}

MLA_KERNEL void mla_split_mma_fast(const MlaSession* sessions, const MlaItem* items, const float* lsc_max,
                                   const float* q_abs, const float* q_rope, float* part_o, float* part_ml,
                                   float scale, int split_rows, int n_splits) {
    mla_split_mma<false>(sessions, items, lsc_max, q_abs, q_rope, part_o, part_ml, scale, split_rows, n_splits);
}

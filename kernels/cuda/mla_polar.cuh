// PolarQuant v3 rows (tag = bits 2..6; kernels/tq/polar.py) decoded into a shared-memory tile as
// unit-scale ROTATED-domain values, in the codec's storage order (bit-reversed, rotated_order):
// the tree runs top-down from cur[0] = 1; at the level with m values, storage position j of cur
// (element rev_m(j)) reads angle field start + rev_m(j) and writes
//   nxt[j] = cur[j] * cosf(a),  nxt[m + j] = cur[j] * sinf(a)
// in place (each j owns positions j and m + j), one barrier per level: the products are the
// CPU's, element by element. The radius is the hoisted row factor; the host puts q in the same
// order before the launch and the context back after.
// Fields: level 1 has W/2 angles of `bits` bits at bit 0; level l >= 2 has W >> l angles of
// w2 = max(bits - 1, 1) bits; codes are packed LSB-first. Tables (host: PolarLayout.cos_table /
// sin_table): level 1 at offset 0 (2^bits codes), level l >= 2 at 2^bits + (l - 2) 2^w2.
#ifndef MLA_POLAR_CUH
#define MLA_POLAR_CUH
#include "mla_common.cuh"

#define MLA_POLAR_K_MAX (64 + 8 * 32)  // table entries of one width: bits 6, 9 levels (width 512)
#define MLA_POLAR_TABLES (4 * MLA_POLAR_K_MAX)  // cos and sin, for Lc and Rc

MLA_DEVICE int mla_log2(int n) {
    int l = 0;
    while ((1 << l) < n) ++l;
    return l;
}

MLA_DEVICE int mla_polar_w2(int bits) { return bits > 2 ? bits - 1 : 1; }

// Table entries of one width: 2^bits + (log2 W - 1) 2^w2.
MLA_DEVICE int mla_polar_entries(int width, int bits) {
    return (1 << bits) + (mla_log2(width) - 1) * (1 << mla_polar_w2(bits));
}

MLA_DEVICE int mla_bit_reverse(int j, int nbits) {
    return nbits ? (int)(__brev((mla_u32)j) >> (32 - nbits)) : 0;
}

// Rows p0 .. p0 + n - 1 (row `sel ? sel[p] : p`) of one field (base, stride) of width W into dst;
// rows n .. SIMT_TILE - 1 of dst read 0. Every thread of the block must call this.
template <int W, int TILE>
MLA_DEVICE void mla_polar_tile(mla_i64 base, mla_i64 stride, const int* sel, int p0, int n, float (*dst)[W],
                               const float* cos_s, const float* sin_s, int bits) {
    const int tid = threadIdx.x;
    const int w2 = mla_polar_w2(bits), levels = mla_log2(W);
    const int row_bytes = ((W / 2) * bits + (W / 2 - 1) * w2 + 7) / 8;
    for (int idx = tid; idx < TILE * W; idx += blockDim.x) {
        const int t = idx / W, d = idx % W;
        dst[t][d] = (d == 0 && t < n) ? 1.0f : 0.0f;
    }
    __syncthreads();
    for (int l = levels; l >= 1; --l) {
        const int m = W >> l, start = W - 2 * m;
        const int width = l == 1 ? bits : w2;
        const int table = l == 1 ? 0 : (1 << bits) + (l - 2) * (1 << w2);
        for (int idx = tid; idx < n * m; idx += blockDim.x) {
            const int t = idx / m, j = idx % m;
            const mla_u8* row = mla_row(base, stride, sel ? sel[p0 + t] : p0 + t);
            const int field = start + mla_bit_reverse(j, levels - l);
            const int pos = l == 1 ? field * bits : (W / 2) * bits + (field - W / 2) * w2;
            const int byte = pos >> 3;
            mla_u32 word = row[byte];
            if (byte + 1 < row_bytes) word |= (mla_u32)row[byte + 1] << 8;
            const int code = (int)((word >> (pos & 7)) & ((1u << width) - 1u));
            const float c = dst[t][j];
            dst[t][j] = c * cos_s[table + code];
            dst[t][m + j] = c * sin_s[table + code];
        }
        __syncthreads();
    }
}

#endif  // MLA_POLAR_CUH

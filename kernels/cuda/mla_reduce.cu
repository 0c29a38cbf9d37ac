// Merge the split partials of mla_split_* into ctx [n_items, H, KV] (flash-decoding reduce).
// grid = (n_items, H), block = 128. Splits past an item's length were never written: only the
// first ceil(length / split_rows) are read. out = sum_j exp(m_j - M) acc_j / sum_j exp(m_j - M) l_j
#include "mla_common.cuh"

MLA_KERNEL void mla_reduce(const MlaItem* items, const float* part_o, const float* part_ml, float* out,
                           int split_rows, int n_splits) {
    const int item_ix = blockIdx.x, head = blockIdx.y;
    const int used = (items[item_ix].length + split_rows - 1) / split_rows;
    const mla_i64 base = (mla_i64)item_ix * n_splits;
    float big = MLA_NEG_INF;
    for (int j = 0; j < used; ++j) big = fmaxf(big, part_ml[((base + j) * MLA_HEADS + head) * 2]);
    float total = 0.0f;
    for (int j = 0; j < used; ++j) {
        const float* ml = part_ml + ((base + j) * MLA_HEADS + head) * 2;
        total += ml[1] * expf(ml[0] - big);
    }
    const float inv = 1.0f / total;
    for (int d = threadIdx.x; d < MLA_KV; d += blockDim.x) {
        float o = 0.0f;
        for (int j = 0; j < used; ++j) {
            const mla_i64 part = (base + j) * MLA_HEADS + head;
            o += part_o[part * MLA_KV + d] * expf(part_ml[part * 2] - big);
        }
        out[((mla_i64)item_ix * MLA_HEADS + head) * MLA_KV + d] = o * inv;
    }
}

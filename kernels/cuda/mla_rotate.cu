// The v3 rotation (kernels/tq/rotation.py) over rows on the device: attention over int4 rows
// rotates q_abs / q_rope once before the split kernel and unrotates the context once after.
//   rotate(x)   = FWHT(x * sign) * inv_sqrt_n      unrotate(y) = FWHT(y) * inv_sqrt_n * sign
// FWHT stages len = 1, 2, ..., n/2, each pair a[j] = u + v, a[j + len] = u - v in f32: the same
// additions, in the same order, as the CPU, so the results are bitwise those of kernels.tq.
// grid = (rows), block = 128; row r is in[r * n .. r * n + n), n a power of two <= MLA_ROT_MAX.
#include "mla_common.cuh"

#define MLA_ROT_MAX 512

MLA_KERNEL void mla_tq_rotate(const float* in, float* out, const float* signs, float inv_sqrt_n, int n,
                              int unrotate) {
    __shared__ float a[MLA_ROT_MAX];
    const mla_i64 base = (mla_i64)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) a[i] = unrotate ? in[base + i] : in[base + i] * signs[i];
    __syncthreads();
    for (int len = 1; len < n; len <<= 1) {
        for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
            const int j = (p / len) * 2 * len + p % len;
            const float u = a[j], v = a[j + len];
            a[j] = u + v;
            a[j + len] = u - v;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float y = a[i] * inv_sqrt_n;
        out[base + i] = unrotate ? y * signs[i] : y;
    }
}

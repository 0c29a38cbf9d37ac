// Shared definitions of the MLA attention kernels (absorbed decode over the latent cache).
// Compiled by NVRTC (no CUDA headers needed) or, with MLA_EMULATE, as plain C++ on the CPU
// by kernels/cuda/emulator.py (emu_runtime.h supplies threads, barriers and warp shuffles).
//
// Dimensions are compile-time macros set by the loader: MLA_HEADS, MLA_KV (kv_lora), MLA_ROPE.
#ifndef MLA_COMMON_CUH
#define MLA_COMMON_CUH

#ifndef MLA_HEADS
#error "MLA_HEADS, MLA_KV and MLA_ROPE must be defined (-D) by the loader"
#endif

#ifndef MLA_EMULATE
#define MLA_DEVICE __device__ __forceinline__
#define MLA_KERNEL extern "C" __global__
#endif

typedef unsigned char mla_u8;
typedef unsigned short mla_u16;
typedef unsigned int mla_u32;
typedef long long mla_i64;

#define MLA_NEG_INF (-__int_as_float(0x7f800000))  // -inf without math headers
#define MLA_SCALE_MAX 3.4e38f

// One session's cache in device memory: row r of Lc starts at lc + r * lc_stride (bytes), etc.
// fp8 kernels read u8 codes and f32 scales; f32 kernels read f32 rows (scale fields unused).
// Host side: kernels/cuda/launch.py packs this as 8 little-endian int64 (64 bytes).
struct MlaSession {
    mla_i64 lc, rc, lsc, rsc;
    mla_i64 lc_stride, rc_stride, lsc_stride, rsc_stride;
};

// One work item = one query row attending the first `length` rows of session `session`.
// Host side: int32 x 4 (session, q_row, length, pad).
struct MlaItem {
    int session, q_row, length, pad;
};

// e4m3fn code -> float, exact; NaN codes (0x7F, 0xFF) read as 0 like the CPU table.
MLA_DEVICE float mla_fp8_decode(mla_u32 b) {
    b &= 0xFFu;
    if ((b & 0x7Fu) == 0x7Fu) return 0.0f;
    mla_u32 e = (b >> 3) & 15u, m = b & 7u;
    float mag = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;  // 2^-9
    return (b & 0x80u) ? -mag : mag;
}

// The reading rule for scales: usable when > 0 and < 3.4e38, else the row is inert (0).
MLA_DEVICE float mla_sanitize_scale(float s) { return (s > 0.0f && s < MLA_SCALE_MAX) ? s : 0.0f; }

MLA_DEVICE const mla_u8* mla_row(mla_i64 base, mla_i64 stride, int row) {
    return (const mla_u8*)(base + stride * (mla_i64)row);
}

// f32 <-> f16 bit patterns (round to nearest even), and one m16n8k16 tensor-core MMA:
// d[4] (f32, C layout) += A (16x16 f16, row-major fragments) x B (16x8 f16, col-major fragments).
MLA_DEVICE mla_u16 mla_f32_to_f16(float x) {
#ifdef MLA_EMULATE
    return emu_f32_to_f16(x);
#else
    mla_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#endif
}

MLA_DEVICE float mla_f16_to_f32(mla_u16 h) {
#ifdef MLA_EMULATE
    return emu_f16_to_f32(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

MLA_DEVICE void mla_mma(float* d, const mla_u32* a, const mla_u32* b) {
#ifdef MLA_EMULATE
    emu_mma_m16n8k16(d, a, b, d);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Dynamic shared memory: the GPU's extern array, or a static buffer when emulated.
#ifdef MLA_EMULATE
#define MLA_DYNAMIC_SMEM(name) static unsigned char name[256 * 1024] __attribute__((aligned(16)))
#else
#define MLA_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

MLA_DEVICE float mla_warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

MLA_DEVICE float mla_warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

#endif  // MLA_COMMON_CUH

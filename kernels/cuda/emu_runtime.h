// CPU emulation of the little of CUDA the attention kernels use, for tests without a GPU.
//
// Every CUDA thread of a block is a fiber run by one OS thread; a fiber yields only at
// __syncthreads() and at warp-collective points (shuffles, mma), so the run is deterministic. A
// fiber's stack is set up once by makecontext/setcontext; every switch after that is an
// _setjmp/_longjmp pair, which saves no signal mask: swapcontext made two sigprocmask system calls
// per switch, and the switches were most of an emulated launch's time. A barrier that can never complete (a thread exited or waits elsewhere)
// is reported as a deadlock instead of hanging. Blocks run one after another, so __shared__
// arrays can be function statics. mma.sync is emulated from the PTX ISA fragment layouts.
#pragma once
#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#define MLA_EMULATE 1
#define MLA_DEVICE static inline
#define MLA_KERNEL static
#define __device__
#define __forceinline__ inline
#define __global__
#define __shared__ static
#define __launch_bounds__(...)
#define __restrict__

using std::max;
using std::min;

struct emu_uint3 { unsigned x, y, z; };
struct emu_dim3 { unsigned x, y, z; };

static emu_uint3 threadIdx, blockIdx;
static emu_dim3 blockDim, gridDim;

static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
template <class T> static inline T __ldg(const T* p) { return *p; }

namespace emu {

enum Wait { RUN = 0, BLOCK_BAR = 1, WARP_BAR = 2, DONE = 3 };

struct Fiber {
    ucontext_t ctx;  // its first start only
    jmp_buf at;      // where it yielded
    std::unique_ptr<char[]> stack;
    int wait = RUN;
    bool started = false;
};

struct Block {
    std::vector<Fiber> fibers;
    jmp_buf sched;  // the scheduler, while a fiber runs
    int current = 0;
    bool deadlock = false;
    void (*body)(void*) = nullptr;
    void* closure = nullptr;
    uint32_t slots[32][32][8];  // [warp][lane][words] exchange area of warp collectives
};

static Block* blk = nullptr;
static const size_t kStackBytes = 1 << 17;

static inline void set_thread(int i) { threadIdx.x = (unsigned)i; threadIdx.y = threadIdx.z = 0; }

static inline void yield(int why) {
    Fiber& f = blk->fibers[blk->current];
    f.wait = why;
    if (_setjmp(f.at) == 0) _longjmp(blk->sched, 1);
    set_thread(blk->current);
}

static void fiber_entry() {
    blk->body(blk->closure);
    blk->fibers[blk->current].wait = DONE;
    _longjmp(blk->sched, 1);  // never returns: its stack is dropped with the block
}

// Run fiber `i` until it yields or ends. Kept out of line so that no local of the scheduler's
// loop lives across the _setjmp (their values would be indeterminate after the _longjmp back).
static __attribute__((noinline)) void resume(Block& b, int i) {
    Fiber& f = b.fibers[i];
    if (_setjmp(b.sched) != 0) return;
    if (!f.started) {
        f.started = true;
        setcontext(&f.ctx);  // onto its own stack, once
    }
    _longjmp(f.at, 1);
}

// Release a group of fibers when every member waits at the same barrier kind.
static bool release_if_complete(int first, int count, int kind) {
    for (int i = first; i < first + count; ++i)
        if (blk->fibers[i].wait != kind) return false;
    for (int i = first; i < first + count; ++i) blk->fibers[i].wait = RUN;
    return true;
}

// Run one block of `n` threads to completion; returns false on deadlock.
static bool run_block(int n, void (*body)(void*), void* closure) {
    Block b;
    b.fibers.resize(n);
    b.body = body;
    b.closure = closure;
    blk = &b;
    for (int i = 0; i < n; ++i) {
        Fiber& f = b.fibers[i];
        f.stack.reset(new char[kStackBytes]);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.get();
        f.ctx.uc_stack.ss_size = kStackBytes;
        f.ctx.uc_link = nullptr;  // fiber_entry never returns
        makecontext(&f.ctx, fiber_entry, 0);
    }
    for (;;) {
        bool ran = false, all_done = true;
        for (int i = 0; i < n; ++i) {
            if (b.fibers[i].wait == RUN) {
                b.current = i;
                set_thread(i);
                resume(b, i);
                ran = true;
            }
            if (b.fibers[i].wait != DONE) all_done = false;
        }
        if (all_done) break;
        if (ran) continue;
        bool released = release_if_complete(0, n, BLOCK_BAR);
        for (int w = 0; w * 32 < n; ++w) released |= release_if_complete(w * 32, min(32, n - w * 32), WARP_BAR);
        if (!released) {
            b.deadlock = true;
            break;
        }
    }
    blk = nullptr;
    return !b.deadlock;
}

template <class F>
static void call_closure(void* p) { (*static_cast<F*>(p))(); }

// Launch `fn` over the grid; returns 0, or 1 when a block deadlocked.
template <class F>
static int launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, F fn) {
    gridDim = {gx, gy, gz};
    blockDim = {bx, 1, 1};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = {x, y, z};
                if (!run_block((int)bx, call_closure<F>, &fn)) {
                    std::fprintf(stderr, "emu: deadlock in block (%u,%u,%u)\n", x, y, z);
                    return 1;
                }
            }
    return 0;
}

static inline int lane() { return (int)(threadIdx.x % 32); }
static inline int warp() { return (int)(threadIdx.x / 32); }

}  // namespace emu

static inline void __syncthreads() { emu::yield(emu::BLOCK_BAR); }

static inline void __syncwarp(unsigned = 0xffffffffu) { emu::yield(emu::WARP_BAR); }

template <class T>
static inline T __shfl_xor_sync(unsigned, T v, int off) {
    static_assert(sizeof(T) <= 32, "slot too small");
    uint32_t* mine = emu::blk->slots[emu::warp()][emu::lane()];
    std::memcpy(mine, &v, sizeof(T));
    emu::yield(emu::WARP_BAR);
    T out;
    std::memcpy(&out, emu::blk->slots[emu::warp()][emu::lane() ^ off], sizeof(T));
    emu::yield(emu::WARP_BAR);
    return out;
}

template <class T>
static inline T __shfl_sync(unsigned, T v, int src) {
    uint32_t* mine = emu::blk->slots[emu::warp()][emu::lane()];
    std::memcpy(mine, &v, sizeof(T));
    emu::yield(emu::WARP_BAR);
    T out;
    std::memcpy(&out, emu::blk->slots[emu::warp()][src & 31], sizeof(T));
    emu::yield(emu::WARP_BAR);
    return out;
}

// ---- f16 helpers (the kernels use inline PTX on the GPU) ----
static inline unsigned short emu_f32_to_f16(float x) {
    _Float16 h = (_Float16)x;  // round to nearest even, like cvt.rn.f16.f32
    unsigned short u;
    std::memcpy(&u, &h, 2);
    return u;
}
static inline float emu_f16_to_f32(unsigned short u) {
    _Float16 h;
    std::memcpy(&h, &u, 2);
    return (float)h;
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, from the PTX ISA fragment layouts:
//   A (16x16, row): reg r holds (row g + 8*(r&1), cols 2t + 8*(r>>1) + {0,1})  [low half first]
//   B (16x8, col):  reg r holds (rows 2t + 8*r + {0,1}, col g)
//   C/D (16x8):     d0,d1 = (row g, cols 2t, 2t+1); d2,d3 = (row g+8, cols 2t, 2t+1)
// with g = lane / 4, t = lane % 4.
static inline void emu_mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]) {
    uint32_t* mine = emu::blk->slots[emu::warp()][emu::lane()];
    for (int r = 0; r < 4; ++r) mine[r] = a[r];
    mine[4] = b[0];
    mine[5] = b[1];
    emu::yield(emu::WARP_BAR);
    auto a_at = [](int row, int k) -> float {
        int ln = (row % 8) * 4 + (k % 8) / 2, reg = (row / 8) + 2 * (k / 8);
        uint32_t w = emu::blk->slots[emu::warp()][ln][reg];
        return emu_f16_to_f32((unsigned short)((k & 1) ? (w >> 16) : (w & 0xFFFF)));
    };
    auto b_at = [](int k, int col) -> float {
        int ln = col * 4 + (k % 8) / 2, reg = k / 8;
        uint32_t w = emu::blk->slots[emu::warp()][ln][4 + reg];
        return emu_f16_to_f32((unsigned short)((k & 1) ? (w >> 16) : (w & 0xFFFF)));
    };
    const int g = emu::lane() / 4, t = emu::lane() % 4;
    float out[4];
    for (int i = 0; i < 4; ++i) {
        int row = g + 8 * (i / 2), col = 2 * t + (i & 1);
        float s = c[i];
        for (int k = 0; k < 16; ++k) s += a_at(row, k) * b_at(k, col);
        out[i] = s;
    }
    emu::yield(emu::WARP_BAR);
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

static inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}

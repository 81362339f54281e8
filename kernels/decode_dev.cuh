/* decode_dev.cuh - what the decode attention's device files share (kernels/decode*.cu):
 * the kernels' parameters, the device helpers (copies, conversions, mma, PDL), the launch
 * helpers and the plan handle. Internal: the contracts are in tkv_kernels.h, the CPU side of
 * the same rules in decode_internal.h.
 *
 * The files, one job each, behind the one header:
 *   decode_plan.cu     the plan kernel and the plan handle (create, plan, download)
 *   decode_cta.cu      the CTA kernel (every shape but FP8 Q over FP8 KV with <= 32 rows)
 *   decode_warp.cu     the warp-worker kernel (FP8 Q over FP8 KV, <= 32 rows: the fast path)
 *   decode_wg.cu       the warpgroup kernel (FP8 Q over FP8 KV, D 128, <= 64 rows: wgmma)
 *   decode_combine.cu  the combine (partials to O and LSE) and merge states
 *   decode.cu          the entry points: kernel choice, shared-memory limits, launches
 * Kernels stay in an unnamed namespace inside their file; each file exports the few host
 * functions declared at the end of this header. */
#ifndef TKVK_DECODE_DEV_CUH
#define TKVK_DECODE_DEV_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <mutex>
#include <stdint.h>
#include <stdlib.h>
#include <type_traits>

#include "decode_internal.h"
#include "fp8.cuh"
#include "tkvk_cuda.cuh"


struct tkvk_decode_plan;

namespace tkvk_dec {

constexpr int kTileTokens = TKVK_DECODE_TILE_TOKENS;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kPlanThreads = 512;
/* Per-pair values of the plan kernel: request, first bin, last whole bin, join base, length,
 * tile start, first task, first slot. */
constexpr int kPlanPairInts = 8;
/* Tasks of a bin kept in shared memory (a bin with more reads the rest from global memory). */
constexpr int kTaskWindow = 128;
/* Warp workers per CTA of the warp-worker kernel at most (its launch bounds). */
constexpr int kMaxCtaWarps = 8;
#ifndef TKVK_DEC_STAGES
/* cp.async stages for token rows under 256 bytes: tiles in flight per CTA = stages - 1. */
#define TKVK_DEC_STAGES 4
#endif

/* ============================================================================================
 * Parameters and per-shape constants
 * ========================================================================================== */

struct DecParams {
    const uint8_t *pool_layer; /* pool + layer * layer_stride */
    size_t block_stride, token_stride, v_offset, kscale_offset;
    int page_tokens, page_shift, num_kv_heads, num_blocks;
    const int32_t *block_table;
    int bt_stride;
    const int32_t *kv_lens;
    int num_requests;
    const void *q;
    const float *q_scales;
    int q_fp8, num_q_heads, group, q_len, rows;
    int per_token_head;
    float k_scale, v_scale;
    const float *v_head_scales;
    float score_scale; /* sm_scale * log2(e) */
    /* task map (dynamic) or the static split geometry */
    const int4 *tasks;
    const int32_t *task_len; /* kv_len of each task's request, written by the plan */
    const int32_t *task_slot; /* the slot of each task's partial (warp-worker kernel) */
    const int32_t *bin_first;
    /* warp-worker kernel: each warp's head (WarpHead, written by the plan kernel's pass 3) */
    const int2 *worker_span;
    const int4 *worker_task0;
    const int4 *worker_aux0;
    int static_splits, static_chunk_tiles;
    /* partial results: [slot][rows][D] and [slot][rows] (slot = task in the CTA kernel) */
    float *part_o;
    float *part_lse;
    /* direct: a task that is a whole (request, KV head) writes out/lse itself (the combine
     * skips pairs of one task); only the warp-worker kernel's dynamic path */
    int direct;
    uint16_t *out;
    float *lse;
};

template <int D, bool FP8KV> struct Shape {
    static constexpr int kElemBytes = FP8KV ? 1 : 2;
    static constexpr int kRowBytes = D * kElemBytes;     /* one token of one head */
    static constexpr int kChunks = kRowBytes / 16;       /* 16-byte chunks per token row */
    static constexpr int kChunkElems = 16 / kElemBytes;
    static constexpr int kStepsPerChunk = kChunkElems / 4; /* mma k-steps a lane takes per chunk */
    static constexpr int kKSteps = D / 16;
    static constexpr int kNBlocks = D / 8;               /* n-blocks of 8 output dims */
    static constexpr int kSliceBytes = kRowBytes / 8;    /* V bytes of one row a lane reads */
    static constexpr int kStages = kRowBytes >= 256 ? 2 : TKVK_DEC_STAGES;
    static constexpr int kTileBytes = kTileTokens * kRowBytes;
};

/* Swizzles of the 16-byte chunks of a token row in shared memory, chosen so the reads below
 * hit 8 distinct 16-byte bank groups per quarter warp (a lane reads K by token row, 4 lanes
 * per row; V by 4 rows 2 apart, 8 lanes side by side in a row). */
template <int kChunks> __device__ __forceinline__ int swz_k(int row)
{
    return kChunks >= 8 ? (row & 1) << 2 : 0;
}
template <int kChunks> __device__ __forceinline__ int swz_v(int row);

/* Byte address in a V stage of byte `off` of token row `row` (swizzled by 16-byte chunk). */
template <int kRowBytes> __device__ __forceinline__ int v_addr(int row, int off)
{
    constexpr int kChunks = kRowBytes / 16;
    return row * kRowBytes + (((off >> 4) ^ swz_v<kChunks>(row)) << 4) + (off & 15);
}

template <int kChunks> __device__ __forceinline__ int swz_v(int row)
{
    if (kChunks == 4)
        return ((row >> 1) & 1) << 1;
    if (kChunks == 8)
        return row & 6;
    if (kChunks == 16)
        return ((row >> 1) & 1) | (((row >> 2) & 1) << 2);
    return (row >> 1) & 3;
}

/* ============================================================================================
 * Small device helpers
 * ========================================================================================== */

__device__ __forceinline__ void pdl_wait()
{
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void pdl_trigger()
{
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 4 bytes global -> shared; src_bytes 0 writes zeros. (The 16-byte K/V copies are written
 * inline in issue_tile, on shared addresses computed once.) */
__device__ __forceinline__ void cp_async4(void *dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint4 lds128(const void *p)
{
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(smem_u32(p)));
    return v;
}
__device__ __forceinline__ uint2 lds64(const void *p)
{
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(smem_u32(p)));
    return v;
}

/* Four e4m3 codes -> f16x2 of bytes 0, 1 (lo) and of bytes 2, 3 (hi), exact. Each conversion
 * reads its half of the word in place, so no mask or shift comes before it. */
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t four, uint32_t &lo, uint32_t &hi)
{
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; "
        "cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi)
        : "r"(four));
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel)
{
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

/* One 32-bit word (4 e4m3 dims) of V from each of 4 token rows (x0, x1: tokens t, t + 1; x2,
 * x3: t + 8, t + 9) as f16x2 token pairs, exact: b[u][0] = (x0, x1) at dim u, b[u][1] = (x2, x3)
 * at dim u. They are P.V's B fragments where V is the mma's B operand, and its A fragments where
 * V^T is the A operand. */
__device__ __forceinline__ void e4m3_token_pairs(uint32_t x0, uint32_t x1, uint32_t x2,
                                                 uint32_t x3, uint32_t (&b)[4][2])
{
    const uint32_t lo01 = prmt(x0, x1, 0x5140), hi01 = prmt(x0, x1, 0x7362);
    const uint32_t lo23 = prmt(x2, x3, 0x5140), hi23 = prmt(x2, x3, 0x7362);
    e4m3x4_to_f16x2(lo01, b[0][0], b[1][0]);
    e4m3x4_to_f16x2(lo23, b[0][1], b[1][1]);
    e4m3x4_to_f16x2(hi01, b[2][0], b[3][0]);
    e4m3x4_to_f16x2(hi23, b[2][1], b[3][1]);
}

template <bool F16> __device__ __forceinline__ uint32_t pack2(float lo, float hi)
{
    if (F16) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    return tkvk_bf16x2_from_float2(lo, hi);
}

/* d += a * b, m16n8k16, row.col, f32 accumulate; F16: f16 operands, else bf16. */
template <bool F16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1)
{
    if (F16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* 2^x on the SFU (2 ulp; 2^-inf = +0): the softmax weights need no more. */
__device__ __forceinline__ float fast_exp2(float x)
{
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

/* d += a * b, m16n8k32, e4m3 operands, f32 accumulate. */
__device__ __forceinline__ void mma16832_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                              uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float quad_max(float x)
{
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x)
{
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/* ============================================================================================
 * Plan kernel
 * ========================================================================================== */

/* Exclusive scan of one value per thread over the whole block; returns the prefix, *total
 * gets the block's sum. Every thread of the block must call it. */
template <typename T> __device__ T block_exclusive_scan(T v, T *total)
{
    __shared__ T warp_sums[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    T x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        T y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o)
            x += y;
    }
    if (lane == 31)
        warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        T w = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            T y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o)
                w += y;
        }
        warp_sums[lane] = w; /* inclusive */
    }
    __syncthreads();
    T warp_prefix = warp ? warp_sums[warp - 1] : 0;
    *total = warp_sums[nwarps - 1];
    __syncthreads(); /* warp_sums is reused by the next call */
    return warp_prefix + x - v;
}

__device__ __forceinline__ int tiles_of(int32_t len)
{
    return len <= 0 ? 0 : (len + kTileTokens - 1) / kTileTokens;
}

/* Row r of pair (req, kvh) as an index into q, q_scales, out and lse: a pair's rows are its
 * query tokens t times its group's heads gh, r = t * group + gh. P: DecParams or CombineParams. */
template <typename P>
__device__ __forceinline__ size_t row_index(const P &p, int req, int kvh, int r)
{
    int t = r / p.group, gh = r % p.group;
    return ((size_t)req * p.q_len + t) * p.num_q_heads + (size_t)kvh * p.group + gh;
}

/* ============================================================================================
 * Launch helpers
 * ========================================================================================== */

typedef void (*attend_fn)(const DecParams);

struct AttendVariant {
    attend_fn fn;
    size_t smem;
    int threads;
};

/* Launch with programmatic stream serialisation: the kernel may start while the previous one
 * in the stream drains; it waits with griddepcontrol.wait before reading its inputs. */
template <typename... Args>
cudaError_t launch_pdl(void (*fn)(Args...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, Args... args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, fn, args...);
}

/* The combine kernel's parameters (decode_combine.cu). */
struct CombineParams {
    const float *part_o, *part_lse;
    const int32_t *pair_first, *pair_count; /* NULL: static, splits per pair */
    int static_splits;
    int num_kv_heads, num_q_heads, group, q_len, rows, head_dim, num_pairs;
    int direct; /* pairs of one task were written by the attention kernel */
    uint16_t *out;
    float *lse;
};

/* Set by tkvk__decode_kernel() (benchmarks): TKVK__DEC_* for plans made and steps launched
 * while it is set. */
extern int g_kernel;
/* Set by tkvk__decode_tune() (benchmarks, tests): the combine's shape; 0 the launcher's
 * choice. */
extern int g_combine;
/* Set by tkvk__decode_cta_warps() (benchmarks): warps per CTA of the warp-worker kernel in
 * plans made from now on (an SM still holds kWarpWorkersPerSm of them); 0 the launcher's
 * choice. */
extern int g_cta_warps;
/* Eight: measured on an H200 against 9 to 13 (as many as fit for WarpMathT at D = 128, which
 * leaves L1 28 KB), eight was as fast or faster on nearly every benchmark case (docs/perf.md). */
constexpr int kWarpWorkersPerSm = 8;

/* decode_cta.cu: the CTA kernel for this shape (NW 8 when wide, past 64 rows; else 4);
 * fn NULL for a head dim / dtype outside the set. */
AttendVariant dec_cta_variant(int head_dim, bool fp8, bool q8, bool wide);
/* decode_warp.cu: the warp-worker kernel for rows <= 32 (<= 16 at D 256); which:
 * TKVK__DEC_WARP_M16 forces rows on the mma's M side for <= 8 rows. fn NULL outside the set. */
AttendVariant dec_warp_variant(int head_dim, int rows, int which);
/* decode_wg.cu: the warpgroup kernel (FP8 Q over FP8 KV) for head dim 128 and 1..64 rows
 * (N = rows padded to 16, 32, 48, 64); fn NULL outside the set. */
AttendVariant dec_wg_variant(int head_dim, int rows);
/* decode_wg.cu: every warpgroup kernel's shared-memory limit (each of its forms). */
cudaError_t dec_wg_set_smem(void);
/* Set by tkvk__decode_wg_form() (benchmarks, tests): the warpgroup kernel's form
 * (tkvk__decode_wg_form); 0 the launcher's choice. */
extern int g_wg_form;
bool dec_wg_form_valid(int form);
/* decode.cu: the warpgroup kernel's form for `rows` rows in the launcher's choice. */
int dec_wg_default_form(int rows);
/* Whether the kernel choice `which` for FP8 Q over FP8 KV at head dim 128 and `rows` rows is
 * the warpgroup kernel (in the launcher's choice only where measured faster, docs/perf.md). */
bool dec_wg_wanted(int rows, int which);
/* decode_combine.cu: the combine for `pairs` pairs, K warps per row and S head-dim slices chosen
 * from the row count (or g_combine). */
cudaError_t dec_launch_combine(const CombineParams &cp, int pairs, int num_sms, cudaStream_t s);
cudaError_t dec_launch_merge(const uint16_t *o_a, const float *lse_a, const uint16_t *o_b,
                             const float *lse_b, int num_rows, int head_dim, uint16_t *out,
                             float *out_lse, cudaStream_t s);
/* decode_plan.cu: sets the plan kernel's shared-memory limit for a CTA opt-in of `optin`. */
cudaError_t dec_plan_set_smem(int optin);
/* decode.cu */
/* Warp workers of `smem` bytes each that a CTA of `optin` bytes holds, at most `want` and
 * kMaxCtaWarps (at least 1). */
int dec_fit_warps(size_t smem, int optin, int want);
/* The attention kernel for a step's shape: the warp-worker kernel for FP8 Q over FP8 KV with
 * <= 16 rows (<= 32 at D <= 128), else the CTA kernel; which: TKVK__DEC_* (benchmarks). */
AttendVariant pick_variant(int head_dim, bool fp8, int rows, bool q8, int which);
/* Once per process for this copy of the kernels: every attention kernel's and the plan
 * kernel's shared-memory limit. */
int dec_set_smem_limits(void);
/* The most shared memory a CTA may opt in to on the current device. */
int dec_smem_optin(int *optin);
/* The kernels' parameters for step a on plan pl (a checked; who names the caller in errors). */
int dec_fill_params(const tkvk_decode_plan *pl, const tkvk_decode_args *a, const char *who,
                    DecParams *p);
/* kind: how the attention kernel left its partials: by static split (the fixed-grid baseline,
 * dev/decode/), by slot (the warp-worker kernel) or by task (the CTA kernel). */
enum DecParts { kPartsStatic, kPartsBySlot, kPartsByTask };
/* The combine of step a after its attention kernel. */
int dec_combine(const tkvk_decode_plan *pl, const tkvk_decode_args *a, const DecParams &p,
                DecParts kind, cudaStream_t s);

} /* namespace tkvk_dec */

struct tkvk_decode_plan {
    int device, num_sms, grid, min_tiles;
    int cta_warps; /* warps per CTA of the warp-worker kernel (1 for the CTA kernel) */
    int may_pair;  /* the plan kernel may give a bin two warps (17..32 rows, dec_warp_kernel) */
    int max_requests, num_kv_heads, max_rows, head_dim;
    int task_cap;
    int4 *tasks;
    int32_t *task_len, *task_slot, *bin_first, *pair_first, *pair_count;
    int32_t *slot_first, *slot_count, *info;
    int32_t *pair_scratch; /* the plan kernel's per-pair values that shared memory cannot hold */
    int2 *worker_span;
    int4 *worker_task0, *worker_aux0;
    float *part_o, *part_lse;
    int planned_requests; /* num_requests of the last plan launch, -1 before the first */
};

#endif

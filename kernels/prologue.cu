/* prologue.cu - the fused prologue as one CUDA kernel (sm_90a) and its launcher.
 *
 * Work decomposition: one (token, head) item per group of D/16 lanes (4, 8 or 16), 16
 * elements per lane, so a warp works on 8, 4 or 2 heads at once. Why this shape:
 *  - per-item work that does not scale with D (index math, the norm's division and square
 *    root, the scale's divisions, the shuffle butterflies) is shared by 16 elements per lane
 *    instead of 4: with one warp per head the kernel was issue-bound at ~25% of HBM rate;
 *  - a lane's elements are 8j..8j+7 and D/2+8j..D/2+8j+7 (two 16-byte loads), so both RoPE
 *    pairings stay inside the lane, and the Hadamard's top stage too;
 *  - reductions are butterflies inside the group (shuffle mask = the group's lanes): no shared
 *    memory and no __syncthreads anywhere;
 *  - consecutive groups take consecutive heads of the same token row, so a warp reads 1 KiB
 *    of contiguous input per round.
 * Variants: one pass with 1, 2 or 4 items per group, and a persistent grid that loads each
 * group's next item before the math of the current one; the launcher picks by size (see
 * launch_d). The tail zero-fill runs in extra CTAs after the token CTAs, one per request.
 *
 * Arithmetic: exactly the header's sequence, with __fmul_rn/__fadd_rn/__fsub_rn/__fdiv_rn/
 * __fsqrt_rn so nvcc cannot contract or approximate anything, and lane partials combined in
 * the butterfly order the CPU reference replays: outputs equal the CPU's bit for bit
 * (gpu_test_prologue checks it over the whole configuration space).
 */
#include <algorithm>

#include <cuda_runtime.h>

#include "fp8.cuh"
#include "tkvk_cuda.cuh"

namespace {

constexpr int kWarpsPerCta = 8;
constexpr int kThreads = kWarpsPerCta * 32;

/* Everything the kernel needs, by value (a __grid_constant__ parameter, no copies). */
struct PrologueArgs {
    const uint16_t *qkv;
    long long qkv_stride;      /* elements */
    int num_tokens, hq, hkv, heads;
    int num_items;             /* num_tokens * heads (< 2^31, checked by the launcher) */
    int main_ctas;
    const int32_t *positions;
    const float *rope_cos, *rope_sin;
    int max_pos;
    int rope_gptj;
    int norm_mode;
    float norm_eps;
    const float *q_norm_weight, *k_norm_weight;
    int hadamard;
    float hadamard_scale;
    int q_fp8;
    void *q_out;
    float *q_scale_out;
    uint8_t *pool_layer;       /* pool + layer * layer_stride */
    long long block_stride, token_stride, v_offset, kscale_offset;
    int page_shift;            /* log2(page_tokens) */
    int kv_fp8, per_token_head;
    long long num_slots;
    const int64_t *slot_mapping;
    float inv_k_scale, inv_v_scale;
    const float *v_head_scales;
    int num_reqs;
    const int64_t *req_last_slot;
    int stride_tokens, stride_heads; /* persistent grid: its item stride as (tokens, heads) */
};

/* ---- one head = LH lanes, 16 elements per lane ------------------------------------------
 * Lane j of a head's group holds x[0..7] = elements 8j .. 8j+7 and x[8..15] = elements
 * D/2 + 8j .. D/2 + 8j + 7: two 16-byte loads, and both RoPE pairings (NeoX (i, i + D/2),
 * GPT-J (2i, 2i+1)) fall inside one lane, so RoPE needs no shuffle. A warp holds 32/LH heads
 * side by side; reductions are butterflies inside the group (shuffle mask = the group). */

__device__ __forceinline__ void unpack8(const uint4 &v, float *x)
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint2 pack8_fp8(const float *x, float inv)
{
    uint32_t w[2];
#pragma unroll
    for (int i = 0; i < 2; i++)
        w[i] = tkvk_fp8x4_from_float4(__fmul_rn(x[4 * i], inv), __fmul_rn(x[4 * i + 1], inv),
                                      __fmul_rn(x[4 * i + 2], inv), __fmul_rn(x[4 * i + 3], inv));
    return make_uint2(w[0], w[1]);
}

__device__ __forceinline__ uint4 pack8_bf16(const float *x)
{
    return make_uint4(tkvk_bf16x2_from_float2(x[0], x[1]), tkvk_bf16x2_from_float2(x[2], x[3]),
                      tkvk_bf16x2_from_float2(x[4], x[5]), tkvk_bf16x2_from_float2(x[6], x[7]));
}

__device__ __forceinline__ void load8f(const float *src, float *dst)
{
    const float4 a = __ldg(reinterpret_cast<const float4 *>(src));
    const float4 b = __ldg(reinterpret_cast<const float4 *>(src) + 1);
    dst[0] = a.x; dst[1] = a.y; dst[2] = a.z; dst[3] = a.w;
    dst[4] = b.x; dst[5] = b.y; dst[6] = b.z; dst[7] = b.w;
}

__device__ __forceinline__ void load4f(const float *src, float *dst)
{
    const float4 a = __ldg(reinterpret_cast<const float4 *>(src));
    dst[0] = a.x; dst[1] = a.y; dst[2] = a.z; dst[3] = a.w;
}

template <int LH> __device__ __forceinline__ void rms_norm(float *x, const float *w, int j,
                                                           unsigned gmask, float eps)
{
    constexpr int D = LH * 16;
    float s = __fmul_rn(x[0], x[0]);
#pragma unroll
    for (int i = 1; i < 16; i++)
        s = __fadd_rn(s, __fmul_rn(x[i], x[i]));
#pragma unroll
    for (int m = LH / 2; m >= 1; m /= 2)
        s = __fadd_rn(s, __shfl_xor_sync(gmask, s, m));
    /* s / D: D is a power of two, so the product by 1/D is the same correctly rounded value. */
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fmul_rn(s, 1.0f / D), eps)));
    float wl[16];
    load8f(w + 8 * j, wl);
    load8f(w + D / 2 + 8 * j, wl + 8);
#pragma unroll
    for (int i = 0; i < 16; i++)
        x[i] = __fmul_rn(__fmul_rn(x[i], inv), wl[i]);
}

template <int LH> __device__ __forceinline__ void rope(float *x, const float *crow,
                                                       const float *srow, int j, bool gptj)
{
    constexpr int D = LH * 16;
    float c[8], s[8];
    if (gptj) {
        /* pairs 4j .. 4j+3 (first chunk) and D/4 + 4j .. (second chunk) */
        load4f(crow + 4 * j, c);
        load4f(crow + D / 4 + 4 * j, c + 4);
        load4f(srow + 4 * j, s);
        load4f(srow + D / 4 + 4 * j, s + 4);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int ia = 2 * k; /* x index of the pair's first element */
            const float a = x[ia], b = x[ia + 1];
            x[ia] = __fsub_rn(__fmul_rn(a, c[k]), __fmul_rn(b, s[k]));
            x[ia + 1] = __fadd_rn(__fmul_rn(b, c[k]), __fmul_rn(a, s[k]));
        }
    } else {
        load8f(crow + 8 * j, c);
        load8f(srow + 8 * j, s);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float a = x[e], b = x[8 + e];
            x[e] = __fsub_rn(__fmul_rn(a, c[e]), __fmul_rn(b, s[e]));
            x[8 + e] = __fadd_rn(__fmul_rn(b, c[e]), __fmul_rn(a, s[e]));
        }
    }
}

/* Butterflies in the header's order h = 1, 2, 4 (inside each 8-chunk), 8 .. D/4 (across the
 * group's lanes: lane xor h/8), D/2 (between the lane's two chunks). */
template <int LH> __device__ __forceinline__ void hadamard(float *x, int j, unsigned gmask,
                                                           float scale)
{
#pragma unroll
    for (int h = 1; h < 8; h *= 2) {
#pragma unroll
        for (int i = 0; i < 16; i++) {
            if (i & h)
                continue;
            const float a = x[i], b = x[i + h];
            x[i] = __fadd_rn(a, b);
            x[i + h] = __fsub_rn(a, b);
        }
    }
#pragma unroll
    for (int m = 1; m < LH; m *= 2) {
        const bool upper = (j & m) != 0;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const float other = __shfl_xor_sync(gmask, x[i], m);
            x[i] = upper ? __fsub_rn(other, x[i]) : __fadd_rn(x[i], other);
        }
    }
#pragma unroll
    for (int e = 0; e < 8; e++) {
        const float a = x[e], b = x[8 + e];
        x[e] = __fadd_rn(a, b);
        x[8 + e] = __fsub_rn(a, b);
    }
#pragma unroll
    for (int i = 0; i < 16; i++)
        x[i] = __fmul_rn(x[i], scale);
}

template <int LH> __device__ __forceinline__ float dynamic_scale(const float *x, unsigned gmask)
{
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++)
        m = fmaxf(m, fabsf(x[i]));
#pragma unroll
    for (int k = LH / 2; k >= 1; k /= 2)
        m = fmaxf(m, __shfl_xor_sync(gmask, m, k));
    return fmaxf(__fdiv_rn(m, TKVK_FP8_MAX), TKVK_MIN_SCALE);
}

/* ---- the kernel ---------------------------------------------------------------------------- */

__device__ void zero_tail(const PrologueArgs &a, int r)
{
    const long long last = a.req_last_slot[r];
    if (last < 0 || last >= a.num_slots)
        return;
    const int P = 1 << a.page_shift;
    const int first = (int)(last & (P - 1)) + 1;
    if (first >= P)
        return;
    uint8_t *page = a.pool_layer + (last >> a.page_shift) * a.block_stride;
    const long long n16 = (long long)(P - first) * a.token_stride / 16; /* token_stride % 64 == 0 */
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 *k = reinterpret_cast<uint4 *>(page + first * a.token_stride);
    uint4 *v = reinterpret_cast<uint4 *>(page + a.v_offset + first * a.token_stride);
    for (long long i = threadIdx.x; i < n16; i += blockDim.x) {
        k[i] = zero;
        v[i] = zero;
    }
    if (a.per_token_head) {
        float *ks = reinterpret_cast<float *>(page + a.kscale_offset) + (long long)first * a.hkv;
        for (int i = threadIdx.x; i < (P - first) * a.hkv; i += blockDim.x)
            ks[i] = 0.0f;
    }
}

/* One (token t, head h) item: the header's steps on the lane's 16 elements, then the stores.
 * pos is read for Q/K heads only, slot for K/V heads only. */
template <int LH>
__device__ __forceinline__ void process_item(const PrologueArgs &a, const uint4 &raw0,
                                             const uint4 &raw1, int t, int h, int pos,
                                             long long slot, int j, unsigned gmask)
{
    constexpr int D = LH * 16;
    float x[16];
    unpack8(raw0, x);
    unpack8(raw1, x + 8);
    if (h < a.hq + a.hkv) {
        /* A position outside the table cannot be refused after launch: clamp so the read
         * stays inside it (the CPU function refuses; callers validate). */
        const int p = min(max(pos, 0), a.max_pos - 1);
        const float *w = h < a.hq ? a.q_norm_weight : a.k_norm_weight;
        if (a.norm_mode == TKVK_NORM_BEFORE_ROPE)
            rms_norm<LH>(x, w, j, gmask, a.norm_eps);
        rope<LH>(x, a.rope_cos + (long long)p * (D / 2), a.rope_sin + (long long)p * (D / 2), j,
                 a.rope_gptj != 0);
        if (a.norm_mode == TKVK_NORM_AFTER_ROPE)
            rms_norm<LH>(x, w, j, gmask, a.norm_eps);
        if (a.hadamard)
            hadamard<LH>(x, j, gmask, a.hadamard_scale);
    }
    if (h < a.hq) {
        const long long row = (long long)t * a.hq + h;
        if (a.q_fp8) {
            const float scale = dynamic_scale<LH>(x, gmask);
            const float inv = __fdiv_rn(1.0f, scale);
            uint8_t *dst = static_cast<uint8_t *>(a.q_out) + row * D + 8 * j;
            *reinterpret_cast<uint2 *>(dst) = pack8_fp8(x, inv);
            *reinterpret_cast<uint2 *>(dst + D / 2) = pack8_fp8(x + 8, inv);
            if (j == 0)
                a.q_scale_out[row] = scale;
        } else {
            uint16_t *dst = static_cast<uint16_t *>(a.q_out) + row * D + 8 * j;
            *reinterpret_cast<uint4 *>(dst) = pack8_bf16(x);
            *reinterpret_cast<uint4 *>(dst + D / 2) = pack8_bf16(x + 8);
        }
        return;
    }
    if (slot < 0 || slot >= a.num_slots)
        return; /* -1: not stored; out of range: never written out of bounds */
    const bool is_v = h >= a.hq + a.hkv;
    const int kvh = is_v ? h - a.hq - a.hkv : h - a.hq;
    const long long off = slot & ((1 << a.page_shift) - 1);
    uint8_t *page = a.pool_layer + (slot >> a.page_shift) * a.block_stride;
    uint8_t *row = page + (is_v ? a.v_offset : 0) + off * a.token_stride;
    if (!a.kv_fp8) {
        uint16_t *dst = reinterpret_cast<uint16_t *>(row) + kvh * D + 8 * j;
        *reinterpret_cast<uint4 *>(dst) = pack8_bf16(x);
        *reinterpret_cast<uint4 *>(dst + D / 2) = pack8_bf16(x + 8);
        return;
    }
    float inv;
    if (!a.per_token_head) {
        inv = is_v ? a.inv_v_scale : a.inv_k_scale;
    } else if (is_v) {
        inv = __fdiv_rn(1.0f, __ldg(a.v_head_scales + kvh));
    } else {
        const float scale = dynamic_scale<LH>(x, gmask);
        inv = __fdiv_rn(1.0f, scale);
        if (j == 0)
            reinterpret_cast<float *>(page + a.kscale_offset)[off * a.hkv + kvh] = scale;
    }
    uint8_t *dst = row + kvh * D + 8 * j;
    *reinterpret_cast<uint2 *>(dst) = pack8_fp8(x, inv);
    *reinterpret_cast<uint2 *>(dst + D / 2) = pack8_fp8(x + 8, inv);
}

template <int LH, int ITEMS>
__global__ void __launch_bounds__(kThreads) prologue_kernel(const __grid_constant__ PrologueArgs a)
{
    constexpr int D = LH * 16, G = 32 / LH;
    if ((int)blockIdx.x >= a.main_ctas) {
        zero_tail(a, (int)blockIdx.x - a.main_ctas);
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = lane / LH, j = lane % LH;
    const unsigned gmask = LH == 32 ? 0xffffffffu : ((1u << LH) - 1u) << (grp * LH);
    /* Round `it` of a warp covers items base + it*G .. + G-1, one per group: consecutive heads,
     * so a warp's loads are contiguous. 32-bit indices: 64-bit division is expensive. */
    const int base = ((int)blockIdx.x * kWarpsPerCta + warp) * ITEMS * G + grp;

    /* Phase 1: every load of every item before any math (bytes in flight). */
    uint4 raw[ITEMS][2];
    int tok[ITEMS], head[ITEMS], pos[ITEMS] = {};
    long long slot[ITEMS] = {};
#pragma unroll
    for (int it = 0; it < ITEMS; it++) {
        const int item = base + it * G;
        tok[it] = item / a.heads;
        head[it] = item - tok[it] * a.heads;
        if (item < a.num_items) {
            const uint16_t *src = a.qkv + (long long)tok[it] * a.qkv_stride + head[it] * D + 8 * j;
            raw[it][0] = __ldcs(reinterpret_cast<const uint4 *>(src)); /* read once: evict-first */
            raw[it][1] = __ldcs(reinterpret_cast<const uint4 *>(src + D / 2));
            if (head[it] < a.hq + a.hkv)
                pos[it] = __ldg(a.positions + tok[it]);
            if (head[it] >= a.hq)
                slot[it] = __ldg(reinterpret_cast<const long long *>(a.slot_mapping) + tok[it]);
        }
    }

    /* Phase 2: math and stores, item by item (branches uniform within a group). */
#pragma unroll
    for (int it = 0; it < ITEMS; it++) {
        if (base + it * G >= a.num_items)
            continue;
        process_item<LH>(a, raw[it][0], raw[it][1], tok[it], head[it], pos[it], slot[it], j,
                         gmask);
    }
}

/* The persistent variant: a grid of resident CTAs; every group walks items item, item +
 * stride, .. and loads the next item's input before working on the current one, so reads
 * stay in flight while the math runs (register double buffering). */
template <int LH>
__global__ void __launch_bounds__(kThreads, 4) prologue_persistent(const __grid_constant__ PrologueArgs a)
{
    constexpr int D = LH * 16, G = 32 / LH;
    if ((int)blockIdx.x >= a.main_ctas) {
        zero_tail(a, (int)blockIdx.x - a.main_ctas);
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = lane / LH, j = lane % LH;
    const unsigned gmask = LH == 32 ? 0xffffffffu : ((1u << LH) - 1u) << (grp * LH);
    const int stride = a.main_ctas * kWarpsPerCta * G;
    int item = ((int)blockIdx.x * kWarpsPerCta + warp) * G + grp;
    if (item >= a.num_items)
        return;

    int t = item / a.heads, h = item - t * a.heads, pos = 0;
    long long slot = -1;
    uint4 r0, r1;
    {
        const uint16_t *src = a.qkv + (long long)t * a.qkv_stride + h * D + 8 * j;
        r0 = __ldcs(reinterpret_cast<const uint4 *>(src));
        r1 = __ldcs(reinterpret_cast<const uint4 *>(src + D / 2));
        if (h < a.hq + a.hkv)
            pos = __ldg(a.positions + t);
        if (h >= a.hq)
            slot = __ldg(reinterpret_cast<const long long *>(a.slot_mapping) + t);
    }
    for (;;) {
        const uint4 c0 = r0, c1 = r1;
        const int ct = t, ch = h, cpos = pos;
        const long long cslot = slot;
        const int next = item + stride;
        const bool more = next < a.num_items && next > item; /* (no wrap-around) */
        if (more) {
            /* next = item + stride without a division: h < heads and stride_heads < heads. */
            t += a.stride_tokens;
            h += a.stride_heads;
            if (h >= a.heads) {
                h -= a.heads;
                t++;
            }
            const uint16_t *src = a.qkv + (long long)t * a.qkv_stride + h * D + 8 * j;
            r0 = __ldcs(reinterpret_cast<const uint4 *>(src));
            r1 = __ldcs(reinterpret_cast<const uint4 *>(src + D / 2));
            if (h < a.hq + a.hkv)
                pos = __ldg(a.positions + t);
            if (h >= a.hq)
                slot = __ldg(reinterpret_cast<const long long *>(a.slot_mapping) + t);
        }
        process_item<LH>(a, c0, c1, ct, ch, cpos, cslot, j, gmask);
        if (!more)
            break;
        item = next;
    }
}

template <int LH, int ITEMS> int launch(PrologueArgs &a, cudaStream_t stream)
{
    constexpr int G = 32 / LH;
    long long warps = ((long long)a.num_items + ITEMS * G - 1) / (ITEMS * G);
    long long ctas = (warps + kWarpsPerCta - 1) / kWarpsPerCta;
    if (ctas + a.num_reqs > 0x7fffffffLL)
        return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cuda: %lld tokens are too many for one "
                          "call", (long long)a.num_tokens);
    a.main_ctas = (int)ctas;
    unsigned grid = (unsigned)(ctas + a.num_reqs);
    if (grid == 0)
        return TKVK_OK;
    prologue_kernel<LH, ITEMS><<<grid, kThreads, 0, stream>>>(a);
    TKVK_CUDA_TRY(cudaGetLastError());
    return TKVK_OK;
}

template <int LH> int launch_persistent(PrologueArgs &a, cudaStream_t stream)
{
    constexpr int G = 32 / LH;
    int dev = 0, sms = 0, per_sm = 0;
    TKVK_CUDA_TRY(cudaGetDevice(&dev));
    TKVK_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    TKVK_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, prologue_persistent<LH>,
                                                                kThreads, 0));
    long long needed = ((long long)a.num_items + kWarpsPerCta * G - 1) / (kWarpsPerCta * G);
    long long ctas = std::min<long long>(needed, (long long)sms * std::max(per_sm, 1));
    a.main_ctas = (int)ctas;
    const int stride = a.main_ctas * kWarpsPerCta * G;
    a.stride_tokens = stride / a.heads;
    a.stride_heads = stride % a.heads;
    unsigned grid = (unsigned)(ctas + a.num_reqs);
    if (grid == 0)
        return TKVK_OK;
    prologue_persistent<LH><<<grid, kThreads, 0, stream>>>(a);
    TKVK_CUDA_TRY(cudaGetLastError());
    return TKVK_OK;
}

constexpr int kLargeCallItems = 300000;

/* items_per_group: 0 = chosen here; 1, 2 or 4 = that many items per group in one pass;
 * 8 = the persistent grid (the benchmark compares them all). */
template <int LH> int launch_d(PrologueArgs &a, cudaStream_t stream, int items_per_group)
{
    switch (items_per_group) {
    case 0:
        /* Measured on an H200 (docs/perf.md). Small calls: one item per
         * group (pure latency; the others are no faster). From ~300K items: the persistent
         * grid when every warp's groups hold heads of one kind (heads per token a multiple of
         * the groups per warp; 64/8 heads, 65536 tokens: 650 us against 752 with two items
         * per group), else two items per group (8/1 heads, where warps mix Q, K and V heads:
         * 100.6 us against 99.1 persistent, no measurable difference). */
        if (a.num_items >= kLargeCallItems)
            return a.heads % (32 / LH) == 0 ? launch_persistent<LH>(a, stream)
                                            : launch<LH, 2>(a, stream);
        return launch<LH, 1>(a, stream);
    case 1: return launch<LH, 1>(a, stream);
    case 2: return launch<LH, 2>(a, stream);
    case 4: return launch<LH, 4>(a, stream);
    case 8: return launch_persistent<LH>(a, stream);
    default:
        return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cuda: items per group %d (1, 2, 4 or 8)",
                          items_per_group);
    }
}

bool aligned(const void *p, size_t n)
{
    return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0;
}

} // namespace

extern "C" int tkvk__prologue_cuda_tuned(const tkvk_prologue_params *p, void *stream,
                                         int items_per_warp)
{
    int rc = tkvk__prologue_check(p, "tkvk_prologue_cuda");
    if (rc != TKVK_OK)
        return rc;
    if (!tkvk_cuda_available())
        return tkvk__fail(TKVK_ENODEV, "tkvk_prologue_cuda: no usable CUDA device");
    const tkvk_layout *lay = p->layout;
    const int d = lay->head_dim;
    if (p->num_tokens > 0) {
        if (!aligned(p->qkv, 16) || !aligned(p->q_out, 16) || (p->qkv_stride % 8) != 0)
            return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cuda: qkv and q_out must be 16-byte "
                              "aligned and qkv_stride a multiple of 8");
    }
    if (p->num_blocks > 0 && !aligned(p->pool, 16))
        return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cuda: pool must be 16-byte aligned");

    PrologueArgs a = {};
    a.qkv = p->qkv;
    a.hq = p->num_q_heads;
    a.hkv = lay->num_kv_heads;
    a.heads = a.hq + 2 * a.hkv;
    a.qkv_stride = p->qkv_stride ? (long long)p->qkv_stride : (long long)a.heads * d;
    a.num_tokens = p->num_tokens;
    if ((long long)p->num_tokens * a.heads + 64LL * 8 >= 0x7fffffffLL)
        return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cuda: %d tokens x %d heads are too many for "
                          "one call (split it)", p->num_tokens, a.heads);
    a.num_items = p->num_tokens * a.heads;
    a.positions = p->positions;
    a.rope_cos = p->rope_cos;
    a.rope_sin = p->rope_sin;
    a.max_pos = p->max_pos;
    a.rope_gptj = p->rope_style == TKVK_ROPE_GPTJ;
    a.norm_mode = p->norm_mode;
    a.norm_eps = p->norm_eps;
    a.q_norm_weight = p->q_norm_weight;
    a.k_norm_weight = p->k_norm_weight;
    a.hadamard = p->hadamard;
    a.hadamard_scale = tkvk_hadamard_scale(d);
    a.q_fp8 = p->q_dtype == TKVK_DTYPE_FP8_E4M3;
    a.q_out = p->q_out;
    a.q_scale_out = p->q_scale_out;
    a.pool_layer = static_cast<uint8_t *>(p->pool) + (size_t)p->layer * lay->layer_stride;
    a.block_stride = (long long)lay->block_stride;
    a.token_stride = (long long)lay->token_stride;
    a.v_offset = (long long)lay->v_offset;
    a.kscale_offset = (long long)lay->kscale_offset;
    a.page_shift = __builtin_ctz((unsigned)lay->page_tokens);
    a.kv_fp8 = lay->kv_dtype == TKVK_DTYPE_FP8_E4M3;
    a.per_token_head = lay->scale_mode == TKVK_SCALE_PER_TOKEN_HEAD;
    a.num_slots = p->num_blocks * lay->page_tokens;
    a.slot_mapping = p->slot_mapping;
    /* The same IEEE division the CPU reference does. */
    a.inv_k_scale = 1.0f / p->k_scale;
    a.inv_v_scale = 1.0f / p->v_scale;
    a.v_head_scales = p->v_head_scales;
    a.num_reqs = p->num_reqs;
    a.req_last_slot = p->req_last_slot;

    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (d) {
    case 64: return launch_d<4>(a, s, items_per_warp);
    case 128: return launch_d<8>(a, s, items_per_warp);
    default: return launch_d<16>(a, s, items_per_warp);
    }
}

extern "C" int tkvk_prologue_cuda(const tkvk_prologue_params *p, void *stream)
{
    return tkvk__prologue_cuda_tuned(p, stream, 0);
}

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
 * Variants: one pass with 1, 2 or 4 items per group; a persistent grid that loads each
 * group's next item before the math of the current one; a walk grid whose warps take tiles
 * of tokens head by head, for head counts where the persistent grid's warps would mix head
 * kinds; two deeper forms of the persistent grid, forced through tkvk__prologue_cuda_tuned()
 * only: a ring grid with two items of input in flight per group in registers, and a grid that
 * prefetches its input into L2 a few items ahead. The persistent and walk grids also come
 * compiled for one fixed set of modes with streaming stores (kOptFixedMode). The launcher
 * picks by size and shape (see launch_d). The tail zero-fill runs in extra CTAs after the token
 * CTAs, one per request.
 *
 * Arithmetic: exactly the header's sequence, with __fmul_rn/__fadd_rn/__fsub_rn/__frcp_rn/
 * __fsqrt_rn so nvcc cannot contract or approximate anything (1/x as __frcp_rn: the same
 * correctly rounded value as the division 1.0f / x, in fewer instructions; amax / 448 as in
 * div448()), and lane partials combined in the butterfly order the CPU reference replays:
 * outputs equal the CPU's bit for bit (gpu_test_prologue checks it over the whole
 * configuration space).
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
    int units, rounds, seg_rounds, nseg, grid_warps; /* walk grid: see prologue_walk */
    int ring_items, ring_tokens, ring_heads; /* ring and prefetching grids: see set_ring */
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

/* A store of an output; CS: streaming (st.global.cs: evict first), written once and never
 * read here. */
template <bool CS, typename V> __device__ __forceinline__ void put(void *dst, const V &v)
{
    if constexpr (CS)
        __stcs(reinterpret_cast<V *>(dst), v);
    else
        *reinterpret_cast<V *>(dst) = v;
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
    const float inv = __frcp_rn(__fsqrt_rn(__fadd_rn(__fmul_rn(s, 1.0f / D), eps)));
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

/* amax / 448 in three operations instead of a full division: q = amax * RN(1/448), then one
 * Markstein correction with the exact remainder (fma). After the floor TKVK_MIN_SCALE that
 * dynamic_scale() applies, it equals the IEEE division for every amax in [0, +inf]
 * (tests/kernels/test_prologue.c replays these operations on the CPU; below the floor the two
 * may differ in the last bit). +inf needs the uncorrected product (inf - inf is NaN), hence
 * the select. amax is never NaN or negative (a maximum of |x| started at 0). */
__device__ __forceinline__ float div448(float m)
{
    const float r = 1.0f / TKVK_FP8_MAX; /* RN(1/448), folded at compile time */
    const float q = __fmul_rn(m, r);
    const float rem = __fmaf_rn(-q, TKVK_FP8_MAX, m);
    const float q2 = __fmaf_rn(rem, r, q);
    return m <= 3.40282347e38f ? q2 : q;
}

template <int LH> __device__ __forceinline__ float dynamic_scale(const float *x, unsigned gmask)
{
    /* max is exact and order free: a tree, not a chain of 16 dependent steps. fmaxf ignores a
     * NaN operand, as the reference's running fmaxf from 0 does (all-NaN lanes give 0 here
     * through the final max with 0). */
    float m4[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        m4[i] = fmaxf(fmaxf(fabsf(x[4 * i]), fabsf(x[4 * i + 1])),
                      fmaxf(fabsf(x[4 * i + 2]), fabsf(x[4 * i + 3])));
    float m = fmaxf(0.0f, fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3])));
#pragma unroll
    for (int k = LH / 2; k >= 1; k /= 2)
        m = fmaxf(m, __shfl_xor_sync(gmask, m, k));
    return fmaxf(div448(m), TKVK_MIN_SCALE);
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

/* Options of the persistent and walk grids (OPT bits): streaming stores (put()); the fixed
 * mode: the call's modes are the anchor's (norm before RoPE, NeoX, no Hadamard, FP8 Q, FP8 K/V
 * with per-tensor scales) and known at compile time, so no per-item test of a mode flag (each
 * a constant load, a compare and a branch; together a tenth of the instructions). */
constexpr int kOptStreamStores = 1, kOptFixedMode = 2;

/* The call's modes: compile-time constants under kOptFixedMode, else read from a. */
template <int OPT> struct Modes {
    static constexpr bool fixed = (OPT & kOptFixedMode) != 0;
    int norm;
    bool gptj, had, q_fp8, kv_fp8, per_token_head;
    __device__ __forceinline__ explicit Modes(const PrologueArgs &a)
        : norm(fixed ? (int)TKVK_NORM_BEFORE_ROPE : a.norm_mode),
          gptj(fixed ? false : a.rope_gptj != 0), had(fixed ? false : a.hadamard != 0),
          q_fp8(fixed || a.q_fp8), kv_fp8(fixed || a.kv_fp8),
          per_token_head(fixed ? false : a.per_token_head != 0)
    {
    }
};

/* Whether the call's modes are the fixed mode's. */
bool fixed_mode(const PrologueArgs &a)
{
    return a.norm_mode == TKVK_NORM_BEFORE_ROPE && !a.rope_gptj && !a.hadamard && a.q_fp8 &&
           a.kv_fp8 && !a.per_token_head;
}

/* One (token t, head h) item, its lane's 16 elements already unpacked into x: the header's
 * steps, then the stores. pos is read for Q/K heads only, slot for K/V heads only. OPT: the
 * kOpt* bits above. */
template <int LH, int OPT = 0>
__device__ __forceinline__ void process_unpacked(const PrologueArgs &a, float *x, int t, int h,
                                                 int pos, long long slot, int j, unsigned gmask)
{
    constexpr int D = LH * 16;
    constexpr bool cs = (OPT & kOptStreamStores) != 0;
    const Modes<OPT> m(a);
    if (h < a.hq + a.hkv) {
        /* A position outside the table cannot be refused after launch: clamp so the read
         * stays inside it (the CPU function refuses; callers validate). */
        const int p = min(max(pos, 0), a.max_pos - 1);
        const float *w = h < a.hq ? a.q_norm_weight : a.k_norm_weight;
        if (m.norm == TKVK_NORM_BEFORE_ROPE)
            rms_norm<LH>(x, w, j, gmask, a.norm_eps);
        rope<LH>(x, a.rope_cos + (long long)p * (D / 2), a.rope_sin + (long long)p * (D / 2), j,
                 m.gptj);
        if (m.norm == TKVK_NORM_AFTER_ROPE)
            rms_norm<LH>(x, w, j, gmask, a.norm_eps);
        if (m.had)
            hadamard<LH>(x, j, gmask, a.hadamard_scale);
    }
    if (h < a.hq) {
        const long long row = (long long)t * a.hq + h;
        if (m.q_fp8) {
            const float scale = dynamic_scale<LH>(x, gmask);
            const float inv = __frcp_rn(scale);
            uint8_t *dst = static_cast<uint8_t *>(a.q_out) + row * D + 8 * j;
            put<cs>(dst, pack8_fp8(x, inv));
            put<cs>(dst + D / 2, pack8_fp8(x + 8, inv));
            if (j == 0)
                a.q_scale_out[row] = scale;
        } else {
            uint16_t *dst = static_cast<uint16_t *>(a.q_out) + row * D + 8 * j;
            put<cs>(dst, pack8_bf16(x));
            put<cs>(dst + D / 2, pack8_bf16(x + 8));
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
    if (!m.kv_fp8) {
        uint16_t *dst = reinterpret_cast<uint16_t *>(row) + kvh * D + 8 * j;
        put<cs>(dst, pack8_bf16(x));
        put<cs>(dst + D / 2, pack8_bf16(x + 8));
        return;
    }
    float inv;
    if (!m.per_token_head) {
        inv = is_v ? a.inv_v_scale : a.inv_k_scale;
    } else if (is_v) {
        inv = __frcp_rn(__ldg(a.v_head_scales + kvh));
    } else {
        const float scale = dynamic_scale<LH>(x, gmask);
        inv = __frcp_rn(scale);
        if (j == 0)
            reinterpret_cast<float *>(page + a.kscale_offset)[off * a.hkv + kvh] = scale;
    }
    uint8_t *dst = row + kvh * D + 8 * j;
    put<cs>(dst, pack8_fp8(x, inv));
    put<cs>(dst + D / 2, pack8_fp8(x + 8, inv));
}

/* The same from the item's two raw 16-byte loads. */
template <int LH, int OPT = 0>
__device__ __forceinline__ void process_item(const PrologueArgs &a, const uint4 &raw0,
                                             const uint4 &raw1, int t, int h, int pos,
                                             long long slot, int j, unsigned gmask)
{
    float x[16];
    unpack8(raw0, x);
    unpack8(raw1, x + 8);
    process_unpacked<LH, OPT>(a, x, t, h, pos, slot, j, gmask);
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

/* (t, h) advanced by the items that (dt, dh) stand for, dh < heads: no division. */
__device__ __forceinline__ void ring_step(const PrologueArgs &a, int &t, int &h, int dt, int dh)
{
    t += dt;
    h += dh;
    if (h >= a.heads) {
        h -= a.heads;
        t++;
    }
}

/* Item (t, h)'s input, this lane's two 16-byte pieces, fetched into L2 (no register written,
 * nothing to wait for). */
template <int LH>
__device__ __forceinline__ void prefetch_input_l2(const PrologueArgs &a, int t, int h, int j)
{
    constexpr int D = LH * 16;
    const uint16_t *src = a.qkv + (long long)t * a.qkv_stride + h * D + 8 * j;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(src));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(src + D / 2));
}

/* The prefetching persistent grid (prologue_persistent with PF > 0) fetches each group's input
 * kPrefetchAhead items on into L2 while it works on an item: the next item's register loads
 * then hit L2, and the DRAM has kPrefetchAhead items' time, not one, to deliver each item,
 * at no register cost (registers and occupancy as the persistent grid: 64, 4 CTAs per SM).
 * L2 holds kPrefetchAhead rounds of the grid's window (64/8 heads: 3 x 4.3 MB). */
constexpr int kPrefetchAhead = 3;

/* The persistent variant: a grid of resident CTAs; every group walks items item, item +
 * stride, .. and loads the next item's input before working on the current one, so reads
 * stay in flight while the math runs (register double buffering). At any moment the grid
 * reads one contiguous window of the input, which the DRAM serves best (warps that each walk
 * their own token rows, 20 KiB apart, measured 24% slower: see prologue_walk).
 * UNI: Hq and Hkv are multiples of the groups per warp, so the G items of a warp are G heads
 * of one token and one kind, and every branch in process_item is warp uniform: the group
 * reductions then use the full warp mask, which nvcc compiles to plain SHFL.BFLY instead of
 * a convergence check (MATCH, REDUX, VOTE, a divergent fallback) per reduction.
 * PF > 0: also prefetch into L2 the input PF items on (see kPrefetchAhead); PF = 0 is the
 * persistent grid itself. OPT: the kOpt* bits. */
template <int LH, bool UNI, int PF = 0, int OPT = 0>
__global__ void __launch_bounds__(kThreads, 4) prologue_persistent(const __grid_constant__ PrologueArgs a)
{
    constexpr int D = LH * 16, G = 32 / LH;
    if ((int)blockIdx.x >= a.main_ctas) {
        zero_tail(a, (int)blockIdx.x - a.main_ctas);
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = lane / LH, j = lane % LH;
    const unsigned gmask = UNI || LH == 32 ? 0xffffffffu : ((1u << LH) - 1u) << (grp * LH);
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
        if constexpr (PF > 0) {
            if (a.num_items - item > a.ring_items) { /* item + PF * stride exists */
                int pt = ct, ph = ch;
                ring_step(a, pt, ph, a.ring_tokens, a.ring_heads);
                prefetch_input_l2<LH>(a, pt, ph, j);
            }
        }
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
        process_item<LH, OPT>(a, c0, c1, ct, ch, cpos, cslot, j, gmask);
        if (!more)
            break;
        item = next;
    }
}

/* ---- the ring grid: the persistent grid with two items of input in flight per group --------
 * The persistent grid's walk (the same items in the same order, so the grid still sweeps one
 * contiguous window of the input), with more bytes in flight: each group keeps a ring of two
 * items' input in registers, item k in buffer k % 2, and refills a buffer with item k + 2 as
 * soon as item k is unpacked into floats, before item k's math. Two items are then in flight
 * during the math and one while a group waits for its next item; the persistent grid has one
 * and none (it unpacks item k, then loads item k + 1).
 * The ring is unrolled (two named buffers, not an array, which nvcc put in local memory), so
 * a buffer is never copied into another: a register move out of a load still in flight would
 * wait for it and serialise the loads again. Registers limit the depth, so only the input is
 * two items ahead: one (token, head) cursor for the item in hand (the refill's address is
 * derived from it), and its position and slot are loaded one item ahead, as in the persistent
 * grid (shared by the token's heads: mostly cache hits).
 * Registers: the second buffer does not fit in 64 (ptxas spilled it: a store to local memory
 * of a load in flight, which waits for the load), so this grid runs 3 CTAs per SM at up to 80
 * registers: 24 warps x 2 KiB of input in flight per SM during the math, against 32 x 1 KiB.
 * A third buffer spilled at 80 registers too. */
template <int LH>
__device__ __forceinline__ void ring_input(const PrologueArgs &a, int t, int h, int j,
                                           uint4 &r0, uint4 &r1)
{
    constexpr int D = LH * 16;
    const uint16_t *src = a.qkv + (long long)t * a.qkv_stride + h * D + 8 * j;
    r0 = __ldcs(reinterpret_cast<const uint4 *>(src)); /* read once: evict-first */
    r1 = __ldcs(reinterpret_cast<const uint4 *>(src + D / 2));
}

__device__ __forceinline__ void ring_meta(const PrologueArgs &a, int t, int h, int &pos,
                                          long long &slot)
{
    if (h < a.hq + a.hkv)
        pos = __ldg(a.positions + t);
    if (h >= a.hq)
        slot = __ldg(reinterpret_cast<const long long *>(a.slot_mapping) + t);
}

/* One turn of the ring: the item in hand (t, h, pos, slot; its input in r0, r1) is unpacked,
 * r0, r1 refilled with the input two items on, the next item's position and slot loaded, the
 * item processed. Then (t, h, pos, slot) is the next item; false when there is none. */
template <int LH>
__device__ __forceinline__ bool ring_turn(const PrologueArgs &a, uint4 &r0, uint4 &r1, int &rem,
                                          int &t, int &h, int &pos, long long &slot, int stride,
                                          int j, unsigned gmask)
{
    float x[16];
    unpack8(r0, x);
    unpack8(r1, x + 8);
    if (rem > a.ring_items) { /* this buffer's next item, two items on */
        int rt = t, rh = h;
        ring_step(a, rt, rh, a.ring_tokens, a.ring_heads);
        ring_input<LH>(a, rt, rh, j, r0, r1);
    }
    int nt = t, nh = h, npos = 0;
    long long nslot = -1;
    const bool more = rem > stride;
    if (more) {
        ring_step(a, nt, nh, a.stride_tokens, a.stride_heads);
        ring_meta(a, nt, nh, npos, nslot);
    }
    process_unpacked<LH>(a, x, t, h, pos, slot, j, gmask);
    rem -= stride; /* rem > 0 before: no overflow */
    t = nt;
    h = nh;
    pos = npos;
    slot = nslot;
    return more;
}

template <int LH, bool UNI>
__global__ void __launch_bounds__(kThreads, 3) prologue_ring(const __grid_constant__ PrologueArgs a)
{
    constexpr int G = 32 / LH;
    if ((int)blockIdx.x >= a.main_ctas) {
        zero_tail(a, (int)blockIdx.x - a.main_ctas);
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = lane / LH, j = lane % LH;
    const unsigned gmask = UNI || LH == 32 ? 0xffffffffu : ((1u << LH) - 1u) << (grp * LH);
    const int stride = a.main_ctas * kWarpsPerCta * G;
    const int item = ((int)blockIdx.x * kWarpsPerCta + warp) * G + grp;
    if (item >= a.num_items)
        return;
    /* rem: items from the one in hand to the end of the call; there is one while rem > 0, a
     * next one while rem > stride, one two items on while rem > ring_items (2 * stride,
     * clamped to INT_MAX). */
    int rem = a.num_items - item;
    int t = item / a.heads, h = item - t * a.heads, pos = 0;
    long long slot = -1;
    uint4 b00, b01, b10 = {}, b11 = {};
    ring_input<LH>(a, t, h, j, b00, b01);
    if (stride < rem) {
        int lt = t, lh = h;
        ring_step(a, lt, lh, a.stride_tokens, a.stride_heads);
        ring_input<LH>(a, lt, lh, j, b10, b11);
    }
    ring_meta(a, t, h, pos, slot);
    for (;;) {
        if (!ring_turn<LH>(a, b00, b01, rem, t, h, pos, slot, stride, j, gmask))
            return;
        if (!ring_turn<LH>(a, b10, b11, rem, t, h, pos, slot, stride, j, gmask))
            return;
    }
}

/* ---- the walk grid (large calls whose warps would mix head kinds) -----------------------
 * For head counts that are not multiples of the groups per warp (8/1: 10 heads per token, 4
 * groups per warp), where the persistent grid's warps mix Q, K and V heads and pay for the
 * divergence (each kind's code path in turn, shuffles with a per-group mask).
 * A grid of resident CTAs; a warp's unit is a tile of G consecutive tokens, group g on token
 * tile*G + g, and the warp walks the heads in rounds: round r, every group on head r of its
 * token. So every round is one kind over the whole warp:
 *  - the branches on the kind are warp uniform and the group reductions use the full warp
 *    mask: plain SHFL.BFLY, no convergence checks;
 *  - per-token work (position, slot, page and row addresses) is done once per tile, not per
 *    head;
 *  - the next round's two 16-byte loads are issued before this round's math (a loader walks
 *    one round ahead, across tiles too); a tile's position and slot are loaded one tile ahead.
 * A group past the last token computes on zeros and stores nothing (the full-mask shuffles
 * need every lane). A unit may be a segment of a tile's rounds, so that calls of a few
 * thousand tokens still give every resident warp work (the launcher).
 * Measured on an H200 and not kept (docs/perf.md): the same walk with the token map (the
 * warp's unit one token, group g on heads r*G + g; 64/8 heads, 65536 tokens: 756 us against
 * 608 for the persistent grid: 4224 warps reading rows 20 KiB apart serve worse than one
 * contiguous window) and with two rounds of input in flight (80 registers, 3 CTAs per SM;
 * 8/1: 89.5 us against 84.1). */
template <int LH>
__device__ __forceinline__ void walk_unit(const PrologueArgs &a, int u, int grp, int &t, int &r,
                                          int &r_end)
{
    constexpr int G = 32 / LH;
    const int q = a.nseg == 1 ? u : u / a.nseg;
    const int seg = u - q * a.nseg;
    t = q * G + grp;
    r = seg * a.seg_rounds;
    r_end = min(r + a.seg_rounds, a.rounds);
}

/* This lane's first input element of token t (a round r then adds r * D). */
template <int LH>
__device__ __forceinline__ const uint16_t *walk_row(const PrologueArgs &a, int t, int j)
{
    return a.qkv + (long long)t * a.qkv_stride + 8 * j;
}

template <int LH>
__device__ __forceinline__ void walk_load(const uint16_t *row, bool valid, int r, uint4 &r0,
                                          uint4 &r1)
{
    constexpr int D = LH * 16;
    if (valid) {
        const uint16_t *src = row + r * D;
        r0 = __ldcs(reinterpret_cast<const uint4 *>(src)); /* read once: evict-first */
        r1 = __ldcs(reinterpret_cast<const uint4 *>(src + D / 2));
    } else {
        r0 = make_uint4(0, 0, 0, 0);
        r1 = r0;
    }
}

__device__ __forceinline__ void walk_meta(const PrologueArgs &a, int t, bool valid, int &pos,
                                          long long &slot)
{
    pos = 0;
    slot = -1;
    if (valid) {
        pos = __ldg(a.positions + t);
        slot = __ldg(reinterpret_cast<const long long *>(a.slot_mapping) + t);
    }
}

/* rope<LH>() with one load pattern for both pairings (the lane's offsets into the row are
 * warp-uniform values, not two code paths) and 32-bit table offsets: the addresses cost a
 * few instructions per round, where the two-path form let nvcc hoist eight 64-bit addresses
 * out of the walk's loop and spill. The same c, s values reach the same pairs as in rope<LH>().
 * cs_row = position * D/2 (< 2^31: the launcher checks). */
template <int LH> __device__ __forceinline__ void rope_walk(const PrologueArgs &a, float *x,
                                                            int cs_row, int j, bool gptj)
{
    constexpr int D = LH * 16;
    const int o0 = cs_row + (gptj ? 4 * j : 8 * j); /* NeoX 8j .. 8j+7; GPT-J pairs 4j .. 4j+3 */
    const int o1 = o0 + (gptj ? D / 4 : 4);         /* .. and D/4 + 4j .. D/4 + 4j + 3 */
    float c[8], s[8];
    load4f(a.rope_cos + o0, c);
    load4f(a.rope_cos + o1, c + 4);
    load4f(a.rope_sin + o0, s);
    load4f(a.rope_sin + o1, s + 4);
    if (gptj) {
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float u = x[2 * k], v = x[2 * k + 1];
            x[2 * k] = __fsub_rn(__fmul_rn(u, c[k]), __fmul_rn(v, s[k]));
            x[2 * k + 1] = __fadd_rn(__fmul_rn(v, c[k]), __fmul_rn(u, s[k]));
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float u = x[e], v = x[8 + e];
            x[e] = __fsub_rn(__fmul_rn(u, c[e]), __fmul_rn(v, s[e]));
            x[8 + e] = __fadd_rn(__fmul_rn(v, c[e]), __fmul_rn(u, s[e]));
        }
    }
}

/* The steps of the header on a Q or K head (kind uniform over the warp). */
template <int LH, int OPT>
__device__ __forceinline__ void walk_qk_math(const PrologueArgs &a, const Modes<OPT> &m, float *x,
                                             const float *w, int cs_row, int j)
{
    constexpr unsigned kAll = 0xffffffffu;
    if (m.norm == TKVK_NORM_BEFORE_ROPE)
        rms_norm<LH>(x, w, j, kAll, a.norm_eps);
    rope_walk<LH>(a, x, cs_row, j, m.gptj);
    if (m.norm == TKVK_NORM_AFTER_ROPE)
        rms_norm<LH>(x, w, j, kAll, a.norm_eps);
    if (m.had)
        hadamard<LH>(x, j, kAll, a.hadamard_scale);
}

/* Where the loads are: the (unit, round) one round ahead of the math, walked on its own (a
 * round's loads depend on nothing the math computes). */
template <int LH> struct WalkLoader {
    int u, r, r_end;
    bool valid;
    const uint16_t *row;

    __device__ __forceinline__ void start(const PrologueArgs &a, int unit, int grp, int j)
    {
        u = unit;
        valid = false;
        if (u < a.units) {
            int t;
            walk_unit<LH>(a, u, grp, t, r, r_end);
            valid = t < a.num_tokens;
            row = walk_row<LH>(a, t, j);
        }
    }
    __device__ __forceinline__ void load(uint4 &r0, uint4 &r1) const
    {
        walk_load<LH>(row, valid, r, r0, r1); /* past the last unit: zeros */
    }
    __device__ __forceinline__ void advance(const PrologueArgs &a, int grp, int j)
    {
        if (u >= a.units)
            return;
        if (++r == r_end)
            start(a, u + a.grid_warps, grp, j);
    }
};

/* OPT: the kOpt* bits; compiled for them, the grid needs more registers (3 CTAs per SM). */
template <int LH, int OPT = 0>
__global__ void __launch_bounds__(kThreads, OPT ? 3 : 4) prologue_walk(const __grid_constant__ PrologueArgs a)
{
    constexpr int D = LH * 16;
    constexpr unsigned kAll = 0xffffffffu;
    constexpr bool cs = (OPT & kOptStreamStores) != 0;
    const Modes<OPT> m(a);
    if ((int)blockIdx.x >= a.main_ctas) {
        zero_tail(a, (int)blockIdx.x - a.main_ctas);
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = lane / LH, j = lane % LH;
    int u = (int)blockIdx.x * kWarpsPerCta + warp; /* warp uniform from here on */
    if (u >= a.units)
        return;
    const int qk_heads = a.hq + a.hkv;
    const long long P1 = (1 << a.page_shift) - 1;

    /* The next round's input, in registers. */
    WalkLoader<LH> ld;
    ld.start(a, u, grp, j);
    uint4 c0, c1;
    ld.load(c0, c1);
    ld.advance(a, grp, j);

    int t, r, r_end, pos;
    long long slot;
    walk_unit<LH>(a, u, grp, t, r, r_end);
    bool valid = t < a.num_tokens;
    walk_meta(a, t, valid, pos, slot);
    /* The next unit's position and slot are fetched one unit ahead. */
    int nu = u + a.grid_warps, npos = 0;
    long long nslot = -1;
    if (nu < a.units) {
        int nt, nr, nr_end;
        walk_unit<LH>(a, nu, grp, nt, nr, nr_end);
        walk_meta(a, nt, nt < a.num_tokens, npos, nslot);
    }

    for (;;) {
        /* Per unit: a position outside the table is clamped (cannot refuse after launch), a
         * slot outside the pool is not stored (never written out of bounds). */
        const int cs_row = min(max(pos, 0), a.max_pos - 1) * (D / 2);
        const bool kv_ok = valid && slot >= 0 && slot < a.num_slots;
        uint8_t *page = a.pool_layer + (kv_ok ? (slot >> a.page_shift) * a.block_stride : 0);
        const int off = (int)(slot & P1);
        const int qbase = t * a.hq; /* < num_items < 2^31 */

        for (; r < r_end; r++) {
            const int h = r; /* this round's head: one kind over the warp */
            float x[16];
            unpack8(c0, x);
            unpack8(c1, x + 8);
            /* The next round's input into the same registers: in flight during the math. */
            ld.load(c0, c1);
            ld.advance(a, grp, j);

            if (h < a.hq) {
                walk_qk_math<LH>(a, m, x, a.q_norm_weight, cs_row, j);
                const long long qrow = (long long)(qbase + h) * D + 8 * j;
                if (m.q_fp8) {
                    const float scale = dynamic_scale<LH>(x, kAll);
                    const float inv = __frcp_rn(scale);
                    const uint2 lo = pack8_fp8(x, inv), hi = pack8_fp8(x + 8, inv);
                    if (valid) {
                        uint8_t *dst = static_cast<uint8_t *>(a.q_out) + qrow;
                        put<cs>(dst, lo);
                        put<cs>(dst + D / 2, hi);
                        if (j == 0)
                            a.q_scale_out[qbase + h] = scale;
                    }
                } else if (valid) {
                    uint16_t *dst = static_cast<uint16_t *>(a.q_out) + qrow;
                    put<cs>(dst, pack8_bf16(x));
                    put<cs>(dst + D / 2, pack8_bf16(x + 8));
                }
            } else {
                const bool is_v = h >= qk_heads;
                const int kvh = h - (is_v ? qk_heads : a.hq);
                if (!is_v)
                    walk_qk_math<LH>(a, m, x, a.k_norm_weight, cs_row, j);
                uint8_t *kvrow = page + (is_v ? a.v_offset : 0) + (long long)off * a.token_stride;
                if (!m.kv_fp8) {
                    if (kv_ok) {
                        uint16_t *dst = reinterpret_cast<uint16_t *>(kvrow) + kvh * D + 8 * j;
                        put<cs>(dst, pack8_bf16(x));
                        put<cs>(dst + D / 2, pack8_bf16(x + 8));
                    }
                } else {
                    float inv;
                    if (!m.per_token_head) {
                        inv = is_v ? a.inv_v_scale : a.inv_k_scale;
                    } else if (is_v) {
                        inv = __frcp_rn(__ldg(a.v_head_scales + kvh));
                    } else {
                        const float scale = dynamic_scale<LH>(x, kAll);
                        inv = __frcp_rn(scale);
                        if (kv_ok && j == 0)
                            reinterpret_cast<float *>(page + a.kscale_offset)[off * a.hkv + kvh] =
                                scale;
                    }
                    const uint2 lo = pack8_fp8(x, inv), hi = pack8_fp8(x + 8, inv);
                    if (kv_ok) {
                        uint8_t *dst = kvrow + kvh * D + 8 * j;
                        put<cs>(dst, lo);
                        put<cs>(dst + D / 2, hi);
                    }
                }
            }
        }
        if (nu >= a.units)
            break;
        u = nu;
        walk_unit<LH>(a, u, grp, t, r, r_end);
        valid = t < a.num_tokens;
        pos = npos;
        slot = nslot;
        nu = u + a.grid_warps;
        if (nu < a.units) {
            int nt, nr, nr_end;
            walk_unit<LH>(a, nu, grp, nt, nr, nr_end);
            walk_meta(a, nt, nt < a.num_tokens, npos, nslot);
        }
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

/* The item stride times `ahead` as ring_items and (ring_tokens, ring_heads). ahead * stride
 * may pass INT_MAX only where no group has an item that far on (num_items < 2^31): clamped,
 * the kernels' test (items left > ring_items) is then never true. */
void set_ring(PrologueArgs &a, int ahead, int stride)
{
    const long long ring = (long long)ahead * stride;
    a.ring_items = (int)std::min<long long>(ring, 0x7fffffffLL);
    a.ring_tokens = (int)std::min<long long>(ring / a.heads, 0x7fffffffLL);
    a.ring_heads = (int)(ring % a.heads);
}

typedef void (*grid_fn)(const PrologueArgs);

/* A grid of resident CTAs sweeping the items (the persistent and ring grids): `uni` or `mixed`
 * by whether a warp's groups hold heads of one kind; ring > 0 sets the cursor `ring` strides
 * ahead (set_ring). */
template <int LH>
int launch_resident(PrologueArgs &a, cudaStream_t stream, grid_fn uni_kernel, grid_fn mixed_kernel,
                    int ring)
{
    constexpr int G = 32 / LH;
    const grid_fn kernel = a.hq % G == 0 && a.hkv % G == 0 ? uni_kernel : mixed_kernel;
    int dev = 0, sms = 0, per_sm = 0;
    TKVK_CUDA_TRY(cudaGetDevice(&dev));
    TKVK_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    TKVK_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
    long long needed = ((long long)a.num_items + kWarpsPerCta * G - 1) / (kWarpsPerCta * G);
    long long ctas = std::min<long long>(needed, (long long)sms * std::max(per_sm, 1));
    a.main_ctas = (int)ctas;
    const int stride = a.main_ctas * kWarpsPerCta * G;
    a.stride_tokens = stride / a.heads;
    a.stride_heads = stride % a.heads;
    if (ring > 0)
        set_ring(a, ring, stride);
    unsigned grid = (unsigned)(ctas + a.num_reqs);
    if (grid == 0)
        return TKVK_OK;
    kernel<<<grid, kThreads, 0, stream>>>(a);
    TKVK_CUDA_TRY(cudaGetLastError());
    return TKVK_OK;
}

/* PF > 0: the prefetching persistent grid (prefetch PF items on); OPT: the kOpt* bits. */
template <int LH, int PF = 0, int OPT = 0> int launch_persistent(PrologueArgs &a, cudaStream_t stream)
{
    return launch_resident<LH>(a, stream, prologue_persistent<LH, true, PF, OPT>,
                               prologue_persistent<LH, false, PF, OPT>, PF);
}

/* The persistent grid with streaming stores, compiled for the fixed mode where the call's modes
 * are those. */
template <int LH> int launch_persistent_fixed(PrologueArgs &a, cudaStream_t stream)
{
    if (fixed_mode(a))
        return launch_persistent<LH, 0, kOptStreamStores | kOptFixedMode>(a, stream);
    return launch_persistent<LH, 0, kOptStreamStores>(a, stream);
}

template <int LH> int launch_ring(PrologueArgs &a, cudaStream_t stream)
{
    return launch_resident<LH>(a, stream, prologue_ring<LH, true>, prologue_ring<LH, false>, 2);
}

template <int LH, int OPT = 0> int launch_walk(PrologueArgs &a, cudaStream_t stream)
{
    constexpr int G = 32 / LH;
    if ((long long)a.max_pos * (LH * 8) > 0x7fffffffLL) /* rope_walk's 32-bit table offsets */
        return launch_persistent<LH>(a, stream);
    int dev = 0, sms = 0, per_sm = 0;
    TKVK_CUDA_TRY(cudaGetDevice(&dev));
    TKVK_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    TKVK_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, prologue_walk<LH, OPT>,
                                                                kThreads, 0));
    const long long resident = (long long)sms * std::max(per_sm, 1) * kWarpsPerCta;
    const long long tiles = ((long long)a.num_tokens + G - 1) / G;
    a.rounds = a.heads;
    /* Split a tile's rounds into segments only when there are fewer than two tiles per
     * resident warp (calls of a few thousand tokens): every warp gets work, at the price of
     * one more position/slot fetch per segment. Splitting more, to even out the warps' last
     * wave of units, measured slower (docs/perf.md). */
    long long nseg = tiles > 0 ? (2 * resident + tiles - 1) / tiles : 1;
    nseg = std::max(1LL, std::min<long long>(nseg, a.rounds));
    a.seg_rounds = (int)((a.rounds + nseg - 1) / nseg);
    a.nseg = (a.rounds + a.seg_rounds - 1) / a.seg_rounds;
    const long long units = tiles * a.nseg;
    if (units > 0x3fffffffLL)
        return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cuda: %d tokens are too many for one call",
                          a.num_tokens);
    a.units = (int)units;
    const long long ctas = std::min<long long>((units + kWarpsPerCta - 1) / kWarpsPerCta,
                                               resident / kWarpsPerCta);
    a.main_ctas = (int)ctas;
    a.grid_warps = a.main_ctas * kWarpsPerCta;
    unsigned grid = (unsigned)(ctas + a.num_reqs);
    if (grid == 0)
        return TKVK_OK;
    prologue_walk<LH, OPT><<<grid, kThreads, 0, stream>>>(a);
    TKVK_CUDA_TRY(cudaGetLastError());
    return TKVK_OK;
}

/* The walk grid with streaming stores, compiled for the fixed mode where the call's modes are
 * those (3 CTAs per SM). */
template <int LH> int launch_walk_fixed(PrologueArgs &a, cudaStream_t stream)
{
    if (fixed_mode(a))
        return launch_walk<LH, kOptStreamStores | kOptFixedMode>(a, stream);
    return launch_walk<LH>(a, stream);
}

/* The default choice, from measurements on an H200 (docs/perf.md): below kGridItems items
 * (decode sizes) one item per group in one pass: pure latency, the grids are no faster. Above
 * it, compiled for the fixed mode with streaming stores where the call's modes are those: the
 * persistent grid (64/8 heads, 65536 tokens: 559-563 us against 624-626 for the plain
 * persistent grid); but when the warps would mix head kinds (Hq or Hkv not a multiple of the
 * groups per warp, as 8/1), the walk grid (8/1 heads, 65536 tokens: 78 us against 88 for the
 * fixed persistent grid and 83 for the plain walk grid; 16384 tokens: 24.9 against 26.0). */
constexpr int kGridItems = 150000;

/* items_per_group: 0 = chosen here; 1, 2 or 4 = that many items per group in one pass;
 * 8 = the persistent grid; 16 = the walk grid; 32 = the ring grid (two items of input in
 * flight per group); 64 = the persistent grid prefetching into L2 kPrefetchAhead items on;
 * 128 = launch_persistent_fixed (the benchmark compares them all). */
template <int LH> int launch_d(PrologueArgs &a, cudaStream_t stream, int items_per_group)
{
    constexpr int G = 32 / LH;
    switch (items_per_group) {
    case 0:
        if (a.num_items < kGridItems)
            return launch<LH, 1>(a, stream);
        if (a.hq % G == 0 && a.hkv % G == 0)
            return launch_persistent_fixed<LH>(a, stream);
        return launch_walk_fixed<LH>(a, stream);
    case 1: return launch<LH, 1>(a, stream);
    case 2: return launch<LH, 2>(a, stream);
    case 4: return launch<LH, 4>(a, stream);
    case 8: return launch_persistent<LH>(a, stream);
    case 16: return launch_walk<LH>(a, stream);
    case 32: return launch_ring<LH>(a, stream);
    case 64: return launch_persistent<LH, kPrefetchAhead>(a, stream);
    case 128: return launch_persistent_fixed<LH>(a, stream);
    case 256: return launch_walk_fixed<LH>(a, stream);
    default:
        return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cuda: items per group %d (1, 2, 4, 8, 16, "
                          "32, 64, 128 or 256)", items_per_group);
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

/* prologue.cu - the fused prologue as one CUDA kernel (sm_90a) and its launcher.
 *
 * Work decomposition: one warp per (token, head) item, D/32 contiguous elements per lane, so
 * a head's RMSNorm and amax are one warp butterfly each and need no shared memory or
 * __syncthreads at all. Items of a token are consecutive (Q heads, K heads, V heads), so a
 * warp's loads are 128..512 contiguous bytes of the QKV row.
 *  - Decode-sized calls (few items) use one item per warp: the whole call is latency, and
 *    more warps in flight shorten it.
 *  - Large calls give each warp kItems items and issue all their loads before any math, so
 *    every warp keeps ~1 KiB of reads in flight: the bandwidth-bound regime needs bytes in
 *    flight, not threads.
 * The tail zero-fill runs in extra CTAs after the token CTAs, one per request.
 *
 * Arithmetic: exactly the header's sequence, with __fmul_rn/__fadd_rn/__fsub_rn/__fdiv_rn/
 * __fsqrt_rn so nvcc cannot contract or approximate anything, and lane partials combined in
 * the butterfly order the CPU reference replays: outputs equal the CPU's bit for bit.
 */
#include <cuda_runtime.h>

#include "fp8.cuh"
#include "tkvk_cuda.cuh"

namespace {

constexpr int kWarpsPerCta = 8;
constexpr int kThreads = kWarpsPerCta * 32;
constexpr unsigned kFull = 0xffffffffu;

/* Everything the kernel needs, by value (a __grid_constant__ parameter, no copies). */
struct PrologueArgs {
    const uint16_t *qkv;
    long long qkv_stride;      /* elements */
    int num_tokens, hq, hkv, heads;
    int num_items;             /* num_tokens * heads (< 2^31, checked by the launcher) */
    int items_per_cta;
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
};

/* ---- vector loads/stores of E elements per lane ------------------------------------------- */

template <int E> struct Vec;  /* E bf16 in, E bytes (fp8) or 2E bytes (bf16) out */
template <> struct Vec<2> { using In = uint32_t; using Out8 = uint16_t; using Out16 = uint32_t; };
template <> struct Vec<4> { using In = uint2; using Out8 = uint32_t; using Out16 = uint2; };
template <> struct Vec<8> { using In = uint4; using Out8 = uint2; using Out16 = uint4; };

template <int E> __device__ __forceinline__ void unpack_bf16(const typename Vec<E>::In &v, float *x)
{
    const uint32_t *w = reinterpret_cast<const uint32_t *>(&v);
#pragma unroll
    for (int i = 0; i < E / 2; i++) {
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

template <int E> __device__ __forceinline__ typename Vec<E>::Out8 pack_fp8(const float *x, float inv)
{
    typename Vec<E>::Out8 out;
    uint16_t *h = reinterpret_cast<uint16_t *>(&out);
#pragma unroll
    for (int i = 0; i < E / 2; i++)
        h[i] = tkvk_fp8x2_from_float2(__fmul_rn(x[2 * i], inv), __fmul_rn(x[2 * i + 1], inv));
    return out;
}

template <int E> __device__ __forceinline__ typename Vec<E>::Out16 pack_bf16(const float *x)
{
    typename Vec<E>::Out16 out;
    uint32_t *w = reinterpret_cast<uint32_t *>(&out);
#pragma unroll
    for (int i = 0; i < E / 2; i++)
        w[i] = tkvk_bf16x2_from_float2(x[2 * i], x[2 * i + 1]);
    return out;
}

/* ---- the per-head steps, one warp, E = D/32 elements per lane ----------------------------- */

template <int E> __device__ __forceinline__ void rms_norm(float *x, const float *w, int lane, float eps)
{
    constexpr int D = E * 32;
    float s = __fmul_rn(x[0], x[0]);
#pragma unroll
    for (int i = 1; i < E; i++)
        s = __fadd_rn(s, __fmul_rn(x[i], x[i]));
#pragma unroll
    for (int m = 16; m >= 1; m /= 2)
        s = __fadd_rn(s, __shfl_xor_sync(kFull, s, m));
    float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(s, (float)D), eps)));
#pragma unroll
    for (int i = 0; i < E; i++)
        x[i] = __fmul_rn(__fmul_rn(x[i], inv), __ldg(w + lane * E + i));
}

/* NeoX: element i pairs with i + D/2, which lives in lane ^ 16 at the same index. The angle
 * index is (lane & 15) * E + i. GPT-J: pairs (2i, 2i+1) sit in one lane, angle lane*E/2 + i. */
template <int E> __device__ __forceinline__ void rope(float *x, const float *c, const float *s,
                                                      int lane, bool gptj)
{
    if (gptj) {
#pragma unroll
        for (int i = 0; i < E / 2; i++) {
            float a = x[2 * i], b = x[2 * i + 1];
            x[2 * i] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i]));
            x[2 * i + 1] = __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, s[i]));
        }
    } else {
        bool upper = lane >= 16;
#pragma unroll
        for (int i = 0; i < E; i++) {
            float other = __shfl_xor_sync(kFull, x[i], 16);
            /* lower lane holds a, upper holds b: a' = a c - b s, b' = b c + a s */
            x[i] = upper ? __fadd_rn(__fmul_rn(x[i], c[i]), __fmul_rn(other, s[i]))
                         : __fsub_rn(__fmul_rn(x[i], c[i]), __fmul_rn(other, s[i]));
        }
    }
}

/* Walsh-Hadamard butterflies h = 1 .. D/2: in-lane for h < E, across lanes (xor h/E) above. */
template <int E> __device__ __forceinline__ void hadamard(float *x, int lane, float scale)
{
#pragma unroll
    for (int h = 1; h < E; h *= 2) {
#pragma unroll
        for (int i = 0; i < E; i++) {
            if (i & h)
                continue;
            float a = x[i], b = x[i + h];
            x[i] = __fadd_rn(a, b);
            x[i + h] = __fsub_rn(a, b);
        }
    }
#pragma unroll
    for (int m = 1; m < 32; m *= 2) {
        bool upper = (lane & m) != 0;
#pragma unroll
        for (int i = 0; i < E; i++) {
            float other = __shfl_xor_sync(kFull, x[i], m);
            x[i] = upper ? __fsub_rn(other, x[i]) : __fadd_rn(x[i], other);
        }
    }
#pragma unroll
    for (int i = 0; i < E; i++)
        x[i] = __fmul_rn(x[i], scale);
}

template <int E> __device__ __forceinline__ float dynamic_scale(const float *x)
{
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < E; i++)
        m = fmaxf(m, fabsf(x[i]));
#pragma unroll
    for (int k = 16; k >= 1; k /= 2)
        m = fmaxf(m, __shfl_xor_sync(kFull, m, k));
    return fmaxf(__fdiv_rn(m, TKVK_FP8_MAX), TKVK_MIN_SCALE);
}

/* ---- the kernel ---------------------------------------------------------------------------- */

template <int E, int ITEMS>
__global__ void __launch_bounds__(kThreads, ITEMS == 1 ? 1 : 4) prologue_kernel(const __grid_constant__ PrologueArgs a)
{
    constexpr int D = E * 32;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;

    if ((int)blockIdx.x >= a.main_ctas) {
        /* Tail zero-fill: rows offset+1 .. P-1 of the request's last page, K, V and scales. */
        int r = blockIdx.x - a.main_ctas;
        long long last = a.req_last_slot[r];
        if (last < 0 || last >= a.num_slots)
            return;
        int P = 1 << a.page_shift;
        int first = (int)(last & (P - 1)) + 1;
        if (first >= P)
            return;
        uint8_t *page = a.pool_layer + (last >> a.page_shift) * a.block_stride;
        long long bytes = (long long)(P - first) * a.token_stride; /* multiple of 64 */
        uint4 zero = make_uint4(0, 0, 0, 0);
        uint4 *k = reinterpret_cast<uint4 *>(page + first * a.token_stride);
        uint4 *v = reinterpret_cast<uint4 *>(page + a.v_offset + first * a.token_stride);
        for (long long i = threadIdx.x; i < bytes / 16; i += blockDim.x) {
            k[i] = zero;
            v[i] = zero;
        }
        if (a.per_token_head) {
            float *ks = reinterpret_cast<float *>(page + a.kscale_offset) + (long long)first * a.hkv;
            for (int i = threadIdx.x; i < (P - first) * a.hkv; i += blockDim.x)
                ks[i] = 0.0f;
        }
        return;
    }

    using In = typename Vec<E>::In;
    /* 32-bit item indices: a 64-bit division costs more than the rest of the index math. */
    const int item0 = ((int)blockIdx.x * kWarpsPerCta + warp) * ITEMS;

    /* Phase 1: issue the loads of every item before any math (bytes in flight). The angles
     * are loaded per item below: they are shared by all heads of a token, so they hit L1/L2,
     * and holding them for all items would cost registers the loads need. */
    In raw[ITEMS];
    int tok[ITEMS], head[ITEMS], pos[ITEMS];
    long long slot[ITEMS];
    bool live[ITEMS];
#pragma unroll
    for (int j = 0; j < ITEMS; j++) {
        const int item = item0 + j;
        live[j] = item < a.num_items;
        tok[j] = live[j] ? item / a.heads : 0;
        head[j] = live[j] ? item - tok[j] * a.heads : 0;
        if (live[j]) {
            const In *src = reinterpret_cast<const In *>(a.qkv + (long long)tok[j] * a.qkv_stride +
                                                         (long long)head[j] * D) + lane;
            raw[j] = __ldcs(src); /* read once: evict-first in L2 */
            if (head[j] < a.hq + a.hkv)
                pos[j] = __ldg(a.positions + tok[j]);
            if (head[j] >= a.hq)
                slot[j] = __ldg(reinterpret_cast<const long long *>(a.slot_mapping) + tok[j]);
        }
    }

    /* Phase 3: math and stores, item by item (warp-uniform branches). */
#pragma unroll
    for (int j = 0; j < ITEMS; j++) {
        if (!live[j])
            continue;
        float x[E];
        unpack_bf16<E>(raw[j], x);
        const int h = head[j], t = tok[j];
        if (h < a.hq + a.hkv) {
            /* Out-of-range positions cannot be refused after launch; clamp so the read stays
             * in the table (the CPU function refuses them; callers validate). */
            const int p = min(max(pos[j], 0), a.max_pos - 1);
            const float *crow = a.rope_cos + (long long)p * (D / 2);
            const float *srow = a.rope_sin + (long long)p * (D / 2);
            float cs[E], sn[E];
            if (a.rope_gptj) {
#pragma unroll
                for (int i = 0; i < E / 2; i++) {
                    cs[i] = __ldg(crow + lane * (E / 2) + i);
                    sn[i] = __ldg(srow + lane * (E / 2) + i);
                }
            } else {
#pragma unroll
                for (int i = 0; i < E; i++) {
                    cs[i] = __ldg(crow + (lane & 15) * E + i);
                    sn[i] = __ldg(srow + (lane & 15) * E + i);
                }
            }
            const float *w = h < a.hq ? a.q_norm_weight : a.k_norm_weight;
            if (a.norm_mode == TKVK_NORM_BEFORE_ROPE)
                rms_norm<E>(x, w, lane, a.norm_eps);
            rope<E>(x, cs, sn, lane, a.rope_gptj != 0);
            if (a.norm_mode == TKVK_NORM_AFTER_ROPE)
                rms_norm<E>(x, w, lane, a.norm_eps);
            if (a.hadamard)
                hadamard<E>(x, lane, a.hadamard_scale);
        }
        if (h < a.hq) {
            long long row = (long long)t * a.hq + h;
            if (a.q_fp8) {
                float scale = dynamic_scale<E>(x);
                auto *dst = reinterpret_cast<typename Vec<E>::Out8 *>(
                    static_cast<uint8_t *>(a.q_out) + row * D) + lane;
                *dst = pack_fp8<E>(x, __fdiv_rn(1.0f, scale));
                if (lane == 0)
                    a.q_scale_out[row] = scale;
            } else {
                auto *dst = reinterpret_cast<typename Vec<E>::Out16 *>(
                    static_cast<uint16_t *>(a.q_out) + row * D) + lane;
                *dst = pack_bf16<E>(x);
            }
            continue;
        }
        if (slot[j] < 0 || slot[j] >= a.num_slots)
            continue; /* -1: not stored; out of range: never written out of bounds */
        const bool is_v = h >= a.hq + a.hkv;
        const int kvh = is_v ? h - a.hq - a.hkv : h - a.hq;
        const long long off = slot[j] & ((1 << a.page_shift) - 1);
        uint8_t *page = a.pool_layer + (slot[j] >> a.page_shift) * a.block_stride;
        uint8_t *dst = page + (is_v ? a.v_offset : 0) + off * a.token_stride;
        if (!a.kv_fp8) {
            reinterpret_cast<typename Vec<E>::Out16 *>(dst + (long long)kvh * D * 2)[lane] =
                pack_bf16<E>(x);
            continue;
        }
        float inv;
        if (!a.per_token_head) {
            inv = is_v ? a.inv_v_scale : a.inv_k_scale;
        } else if (is_v) {
            inv = __fdiv_rn(1.0f, __ldg(a.v_head_scales + kvh));
        } else {
            float scale = dynamic_scale<E>(x);
            inv = __fdiv_rn(1.0f, scale);
            if (lane == 0)
                reinterpret_cast<float *>(page + a.kscale_offset)[off * a.hkv + kvh] = scale;
        }
        reinterpret_cast<typename Vec<E>::Out8 *>(dst + (long long)kvh * D)[lane] =
            pack_fp8<E>(x, inv);
    }
}

template <int E, int ITEMS> int launch(PrologueArgs &a, cudaStream_t stream)
{
    long long warps = ((long long)a.num_items + ITEMS - 1) / ITEMS;
    long long ctas = (warps + kWarpsPerCta - 1) / kWarpsPerCta;
    if (ctas + a.num_reqs > 0x7fffffffLL)
        return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cuda: %lld tokens are too many for one "
                          "call", (long long)a.num_tokens);
    a.main_ctas = (int)ctas;
    a.items_per_cta = kWarpsPerCta * ITEMS;
    unsigned grid = (unsigned)(ctas + a.num_reqs);
    if (grid == 0)
        return TKVK_OK;
    prologue_kernel<E, ITEMS><<<grid, kThreads, 0, stream>>>(a);
    TKVK_CUDA_TRY(cudaGetLastError());
    return TKVK_OK;
}

/* Below this many items a call is latency-bound: one item per warp. */
constexpr long long kManyItems = 32768;

/* items_per_warp: 0 = chosen here; else 1, 2 or 4 (benchmarks compare them). */
template <int E> int launch_d(PrologueArgs &a, cudaStream_t stream, int items_per_warp)
{
    if (items_per_warp == 0) {
        /* ~512..1024 bytes of input per warp in flight in the bandwidth-bound regime, within
         * the 64 registers that keep 4 CTAs (32 warps) resident per SM. */
        items_per_warp = a.num_items < kManyItems ? 1 : (E == 8 ? 2 : 4);
    }
    switch (items_per_warp) {
    case 1: return launch<E, 1>(a, stream);
    case 2: return launch<E, 2>(a, stream);
    case 4: return launch<E, 4>(a, stream);
    default:
        return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cuda: items_per_warp %d (1, 2 or 4)",
                          items_per_warp);
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
    case 64: return launch_d<2>(a, s, items_per_warp);
    case 128: return launch_d<4>(a, s, items_per_warp);
    default: return launch_d<8>(a, s, items_per_warp);
    }
}

extern "C" int tkvk_prologue_cuda(const tkvk_prologue_params *p, void *stream)
{
    return tkvk__prologue_cuda_tuned(p, stream, 0);
}

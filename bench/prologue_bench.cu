/* prologue_bench - the fused prologue against the same work unfused, and against the HBM copy
 * rate, all measured in the same run on the same GPU.
 *
 * Configuration (the anchor's): head dim 128, 64 tokens per page, RMSNorm then RoPE (NeoX),
 * FP8 Q with a dynamic per-(token, head) scale, FP8 K/V with per-tensor scales; Hq/Hkv 64/8
 * and 8/1. Decode sizes (1, 8, 64, 256 tokens) are one token per request at position 4095;
 * prefill sizes (4096, 16384, 65536) are requests of 4096 tokens.
 *
 * Method (the anchor's): one call captured in a CUDA graph, 5 warm-up replays, then 50
 * replays each between its own pair of CUDA events; the median is reported. The unfused path
 * is five kernels written here (norm, RoPE, Q quant, K/V quant, paged store) with bf16
 * intermediates in HBM, captured in one graph the same way. The copy rate is a 1 GiB
 * device-to-device cudaMemcpy (bytes read + written over time, median of 10).
 *
 * Bytes of the fused call: QKV read, positions and slots read, Q codes + Q scales + K/V codes
 * written (the small cos/sin table is L2-resident and not counted).
 *
 * Output: a table on stdout, or with --json a JSON list on stdout and the table on stderr.
 * Exit 77 without a GPU. */
#include <algorithm>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include <cuda_runtime.h>

#include "fp8.cuh"
#include "tkv_kernels.h"
#include "tkvk_internal.h"

#define CHECK(call)                                                                           \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess) {                                                              \
            fprintf(stderr, "prologue_bench: %s: %s (line %d)\n", #call,                     \
                    cudaGetErrorString(e_), __LINE__);                                        \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

#define TKV_CHECK(call)                                                                       \
    do {                                                                                      \
        int r_ = (call);                                                                      \
        if (r_ != TKVK_OK) {                                                                  \
            fprintf(stderr, "prologue_bench: %s: %s\n", #call, tkvk_last_error());            \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

namespace {

constexpr int kD = 128, kE = kD / 32, kP = 64, kDecodePos = 4095, kMaxPos = 4096;

/* ---- the unfused path: one kernel per step, warp per (token, head) row ------------------- */

__device__ __forceinline__ void load_row(const uint16_t *src, int lane, float *x)
{
    uint2 v = reinterpret_cast<const uint2 *>(src)[lane];
    x[0] = __uint_as_float(v.x << 16);
    x[1] = __uint_as_float(v.x & 0xffff0000u);
    x[2] = __uint_as_float(v.y << 16);
    x[3] = __uint_as_float(v.y & 0xffff0000u);
}

__device__ __forceinline__ void store_row_bf16(uint16_t *dst, int lane, const float *x)
{
    reinterpret_cast<uint2 *>(dst)[lane] =
        make_uint2(tkvk_bf16x2_from_float2(x[0], x[1]), tkvk_bf16x2_from_float2(x[2], x[3]));
}

__device__ __forceinline__ long long warp_id()
{
    return ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
}

/* 1: RMSNorm of Q and K heads: qkv -> qk (bf16 [tokens][hq+hkv][D]). */
__global__ void unfused_norm(const uint16_t *qkv, int tokens, int hq, int hkv, const float *qw,
                             const float *kw, float eps, uint16_t *qk)
{
    const int w = (int)warp_id();
    int lane = threadIdx.x & 31, heads = hq + hkv;
    if ((long long)w >= (long long)tokens * heads)
        return;
    int t = (int)(w / heads), h = (int)(w % heads);
    float x[kE];
    load_row(qkv + ((long long)t * (hq + 2 * hkv) + h) * kD, lane, x);
    float s = 0;
    for (int i = 0; i < kE; i++)
        s += x[i] * x[i];
    for (int m = 16; m; m /= 2)
        s += __shfl_xor_sync(0xffffffffu, s, m);
    float inv = rsqrtf(s / kD + eps);
    const float *wt = h < hq ? qw : kw;
    for (int i = 0; i < kE; i++)
        x[i] = x[i] * inv * wt[lane * kE + i];
    store_row_bf16(qk + w * kD, lane, x);
}

/* 2: RoPE (NeoX) of Q and K heads: qk -> qk2. */
__global__ void unfused_rope(const uint16_t *qk, int tokens, int heads, const int32_t *pos,
                             const float *cos_t, const float *sin_t, uint16_t *qk2)
{
    const int w = (int)warp_id();
    int lane = threadIdx.x & 31;
    if ((long long)w >= (long long)tokens * heads)
        return;
    int t = (int)(w / heads);
    float x[kE];
    load_row(qk + w * kD, lane, x);
    const float *c = cos_t + (long long)pos[t] * (kD / 2) + (lane & 15) * kE;
    const float *s = sin_t + (long long)pos[t] * (kD / 2) + (lane & 15) * kE;
    for (int i = 0; i < kE; i++) {
        float o = __shfl_xor_sync(0xffffffffu, x[i], 16);
        x[i] = lane < 16 ? x[i] * c[i] - o * s[i] : x[i] * c[i] + o * s[i];
    }
    store_row_bf16(qk2 + w * kD, lane, x);
}

/* 3: Q quantisation with a dynamic per-(token, head) scale. */
__global__ void unfused_q_quant(const uint16_t *qk2, int tokens, int hq, int hkv, uint8_t *q8,
                                float *qs)
{
    const int w = (int)warp_id();
    int lane = threadIdx.x & 31;
    if ((long long)w >= (long long)tokens * hq)
        return;
    int t = (int)(w / hq), h = (int)(w % hq);
    float x[kE];
    load_row(qk2 + ((long long)t * (hq + hkv) + h) * kD, lane, x);
    float m = 0;
    for (int i = 0; i < kE; i++)
        m = fmaxf(m, fabsf(x[i]));
    for (int k = 16; k; k /= 2)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, k));
    float scale = fmaxf(m / TKVK_FP8_MAX, TKVK_MIN_SCALE), inv = 1.0f / scale;
    reinterpret_cast<uint32_t *>(q8 + w * kD)[lane] =
        tkvk_fp8x4_from_float4(x[0] * inv, x[1] * inv, x[2] * inv, x[3] * inv);
    if (lane == 0)
        qs[w] = scale;
}

/* 4: K (roped) and V (raw) quantisation with per-tensor scales: -> kv8 [tokens][2][hkv][D]. */
__global__ void unfused_kv_quant(const uint16_t *qk2, const uint16_t *qkv, int tokens, int hq,
                                 int hkv, float inv_k, float inv_v, uint8_t *kv8)
{
    const int w = (int)warp_id();
    int lane = threadIdx.x & 31;
    if ((long long)w >= (long long)tokens * 2 * hkv)
        return;
    int t = (int)(w / (2 * hkv)), r = (int)(w % (2 * hkv));
    bool is_v = r >= hkv;
    int h = is_v ? r - hkv : r;
    float x[kE];
    if (is_v)
        load_row(qkv + ((long long)t * (hq + 2 * hkv) + hq + hkv + h) * kD, lane, x);
    else
        load_row(qk2 + ((long long)t * (hq + hkv) + hq + h) * kD, lane, x);
    float inv = is_v ? inv_v : inv_k;
    reinterpret_cast<uint32_t *>(kv8 + w * kD)[lane] =
        tkvk_fp8x4_from_float4(x[0] * inv, x[1] * inv, x[2] * inv, x[3] * inv);
}

/* 5: paged store of kv8 rows by the slot mapping. */
__global__ void unfused_store(const uint8_t *kv8, int tokens, int hkv, const int64_t *slots,
                              uint8_t *pool, long long block_stride, long long token_stride,
                              long long v_offset)
{
    const int w = (int)warp_id();
    int lane = threadIdx.x & 31;
    if ((long long)w >= (long long)tokens * 2 * hkv)
        return;
    int t = (int)(w / (2 * hkv)), r = (int)(w % (2 * hkv));
    long long slot = slots[t];
    if (slot < 0)
        return;
    bool is_v = r >= hkv;
    int h = is_v ? r - hkv : r;
    uint8_t *dst = pool + (slot / kP) * block_stride + (is_v ? v_offset : 0) +
                   (slot % kP) * token_stride + (long long)h * kD;
    reinterpret_cast<uint32_t *>(dst)[lane] = reinterpret_cast<const uint32_t *>(kv8 + w * kD)[lane];
}

unsigned blocks_for_warps(long long warps) { return (unsigned)((warps * 32 + 255) / 256); }

/* ---- timing -------------------------------------------------------------------------------- */

template <class F> double graph_median_us(F &&work, cudaStream_t s)
{
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    work(s);
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 5; i++)
        CHECK(cudaGraphLaunch(ge, s));
    std::vector<cudaEvent_t> ev(100);
    for (auto &e : ev)
        CHECK(cudaEventCreate(&e));
    for (int i = 0; i < 50; i++) {
        CHECK(cudaEventRecord(ev[2 * i], s));
        CHECK(cudaGraphLaunch(ge, s));
        CHECK(cudaEventRecord(ev[2 * i + 1], s));
    }
    CHECK(cudaStreamSynchronize(s));
    std::vector<float> ms(50);
    for (int i = 0; i < 50; i++)
        CHECK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
    for (auto &e : ev)
        CHECK(cudaEventDestroy(e));
    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
    std::sort(ms.begin(), ms.end());
    return 0.5 * (ms[24] + ms[25]) * 1000.0;
}

double copy_rate_bytes_per_s(cudaStream_t s)
{
    const size_t n = (size_t)1 << 30;
    void *a, *b;
    CHECK(cudaMalloc(&a, n));
    CHECK(cudaMalloc(&b, n));
    CHECK(cudaMemset(a, 1, n));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int i = 0; i < 12; i++) {
        CHECK(cudaEventRecord(e0, s));
        CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s));
        CHECK(cudaEventRecord(e1, s));
        CHECK(cudaEventSynchronize(e1));
        float t;
        CHECK(cudaEventElapsedTime(&t, e0, e1));
        if (i >= 2)
            ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    double med = 0.5 * (ms[4] + ms[5]) / 1000.0;
    return 2.0 * (double)n / med;
}

/* Anchor figures (microseconds) from the issue, same method, same GPU model. */
double anchor_us(int tokens, int hq)
{
    static const int toks[7] = {1, 8, 64, 256, 4096, 16384, 65536};
    static const double a64[7] = {16.0, 16.1, 15.9, 16.0, 62.5, 218.7, 843.4};
    static const double a8[7] = {10.4, 10.4, 18.8, 16.1, 16.4, 36.3, 114.0};
    for (int i = 0; i < 7; i++)
        if (toks[i] == tokens)
            return hq == 64 ? a64[i] : a8[i];
    return 0;
}

struct Result {
    int tokens, hq, hkv;
    double fused_us, unfused_us, bytes, anchor;
    /* 1, 2 items per group; persistent grid; walk grid; ring grid (two items of input in
     * flight per group); persistent grid prefetching into L2; persistent grid with streaming
     * stores in the fixed mode */
    double items_us[8];
};

} // namespace

int main(int argc, char **argv)
{
    /* --json: JSON on stdout, the table on stderr; --tokens N, --hq H: that case only (for a
     * profiler run). */
    bool json = false;
    int only_tokens = 0, only_hq = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            json = true;
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            only_tokens = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--hq") && i + 1 < argc)
            only_hq = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: prologue_bench [--json] [--tokens N] [--hq H]\n");
            return 2;
        }
    }
    FILE *table = json ? stderr : stdout;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        fprintf(stderr, "prologue_bench: no CUDA device, skipped\n");
        return 77;
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const double copy_rate = copy_rate_bytes_per_s(s);

    const int token_counts[7] = {1, 8, 64, 256, 4096, 16384, 65536};
    const int hqs[2] = {64, 8}, hkvs[2] = {8, 1};
    const int max_tokens = 65536, max_heads = 64 + 16;

    /* Inputs sized for the largest case, filled once with random bf16 values. */
    uint16_t *qkv, *qk, *qk2;
    uint8_t *q8, *kv8, *pool;
    float *qs, *cos_t, *sin_t, *qw, *kw;
    int32_t *pos;
    int64_t *slots, *last;
    size_t qkv_elems = (size_t)max_tokens * max_heads * kD;
    CHECK(cudaMalloc(&qkv, qkv_elems * 2));
    CHECK(cudaMalloc(&qk, (size_t)max_tokens * 72 * kD * 2));
    CHECK(cudaMalloc(&qk2, (size_t)max_tokens * 72 * kD * 2));
    CHECK(cudaMalloc(&q8, (size_t)max_tokens * 64 * kD));
    CHECK(cudaMalloc(&kv8, (size_t)max_tokens * 16 * kD));
    CHECK(cudaMalloc(&qs, (size_t)max_tokens * 64 * 4));
    CHECK(cudaMalloc(&cos_t, (size_t)kMaxPos * kD / 2 * 4));
    CHECK(cudaMalloc(&sin_t, (size_t)kMaxPos * kD / 2 * 4));
    CHECK(cudaMalloc(&qw, kD * 4));
    CHECK(cudaMalloc(&kw, kD * 4));
    CHECK(cudaMalloc(&pos, max_tokens * 4));
    CHECK(cudaMalloc(&slots, max_tokens * 8));
    CHECK(cudaMalloc(&last, max_tokens * 8));
    {
        std::vector<uint16_t> h(qkv_elems);
        uint64_t r = 88172645463325252ull;
        for (size_t i = 0; i < qkv_elems; i++) {
            r ^= r << 13, r ^= r >> 7, r ^= r << 17;
            h[i] = tkvk_bf16_from_float(((float)(r >> 40) / 16777216.0f - 0.5f) * 4.0f);
        }
        CHECK(cudaMemcpy(qkv, h.data(), qkv_elems * 2, cudaMemcpyHostToDevice));
        std::vector<float> c((size_t)kMaxPos * kD / 2), sn(c.size()), w(kD, 1.0f);
        for (int p = 0; p < kMaxPos; p++)
            for (int i = 0; i < kD / 2; i++) {
                double ang = p * pow(10000.0, -2.0 * i / kD);
                c[(size_t)p * kD / 2 + i] = (float)cos(ang);
                sn[(size_t)p * kD / 2 + i] = (float)sin(ang);
            }
        CHECK(cudaMemcpy(cos_t, c.data(), c.size() * 4, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(sin_t, sn.data(), sn.size() * 4, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(qw, w.data(), kD * 4, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(kw, w.data(), kD * 4, cudaMemcpyHostToDevice));
    }
    /* The pool: as many blocks as the largest case needs (decode: one block per request). */
    tkvk_layout lay8, lay1;
    TKV_CHECK(tkvk_layout_init(&lay8, 1, 8, kD, kP, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR));
    TKV_CHECK(tkvk_layout_init(&lay1, 1, 1, kD, kP, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR));
    const int64_t num_blocks = max_tokens / kP + 256;
    CHECK(cudaMalloc(&pool, (size_t)num_blocks * lay8.block_stride));
    CHECK(cudaMemset(pool, 0, (size_t)num_blocks * lay8.block_stride));

    std::vector<Result> results;
    for (int hc = 0; hc < 2; hc++)
        for (int ti = 0; ti < 7; ti++) {
            const int tokens = token_counts[ti], hq = hqs[hc], hkv = hkvs[hc];
            if ((only_tokens && tokens != only_tokens) || (only_hq && hq != only_hq))
                continue;
            const tkvk_layout *lay = hkv == 8 ? &lay8 : &lay1;
            const bool decode = tokens < 4096;
            const int nreq = decode ? tokens : tokens / 4096;
            std::vector<int32_t> hp(tokens);
            std::vector<int64_t> hs(tokens), hl(nreq);
            for (int t = 0; t < tokens; t++) {
                if (decode) {
                    hp[t] = kDecodePos; /* request t's page t holds positions 4032..4095 */
                    hs[t] = (int64_t)t * kP + kDecodePos % kP;
                    hl[t] = hs[t];
                } else {
                    hp[t] = t % 4096;
                    hs[t] = t; /* request r's 64 pages are blocks 64r .. 64r+63 */
                }
            }
            for (int r = 0; !decode && r < nreq; r++)
                hl[r] = (int64_t)r * 4096 + 4095;
            CHECK(cudaMemcpy(pos, hp.data(), tokens * 4, cudaMemcpyHostToDevice));
            CHECK(cudaMemcpy(slots, hs.data(), tokens * 8, cudaMemcpyHostToDevice));
            CHECK(cudaMemcpy(last, hl.data(), nreq * 8, cudaMemcpyHostToDevice));

            tkvk_prologue_params p;
            tkvk_prologue_params_init(&p);
            p.qkv = qkv;
            p.num_tokens = tokens;
            p.num_q_heads = hq;
            p.positions = pos;
            p.rope_cos = cos_t;
            p.rope_sin = sin_t;
            p.max_pos = kMaxPos;
            p.rope_style = TKVK_ROPE_NEOX;
            p.norm_mode = TKVK_NORM_BEFORE_ROPE;
            p.norm_eps = 1e-6f;
            p.q_norm_weight = qw;
            p.k_norm_weight = kw;
            p.q_dtype = TKVK_DTYPE_FP8_E4M3;
            p.q_out = q8;
            p.q_scale_out = qs;
            p.layout = lay;
            p.layer = 0;
            p.pool = pool;
            p.num_blocks = num_blocks;
            p.slot_mapping = slots;
            p.k_scale = 0.05f;
            p.v_scale = 0.05f;
            p.num_reqs = nreq;
            p.req_last_slot = last;

            Result res = {};
            res.tokens = tokens;
            res.hq = hq;
            res.hkv = hkv;
            res.fused_us = graph_median_us([&](cudaStream_t st) { TKV_CHECK(tkvk_prologue_cuda(&p, st)); }, s);
            /* tkvk__prologue_cuda_tuned() variants: 8 the persistent grid, 16 the walk grid, 32
             * the ring grid, 64 the prefetching persistent grid, 128 the persistent grid with
             * streaming stores in the fixed mode, 256 the walk grid so. */
            const int items[8] = {1, 2, 8, 16, 32, 64, 128, 256};
            for (int v = 0; v < 8; v++)
                res.items_us[v] = graph_median_us(
                    [&](cudaStream_t st) { TKV_CHECK(tkvk__prologue_cuda_tuned(&p, st, items[v])); }, s);
            const float inv_k = 1.0f / p.k_scale, inv_v = 1.0f / p.v_scale;
            res.unfused_us = graph_median_us(
                [&](cudaStream_t st) {
                    long long nqk = (long long)tokens * (hq + hkv), nq = (long long)tokens * hq,
                              nkv = (long long)tokens * 2 * hkv;
                    unfused_norm<<<blocks_for_warps(nqk), 256, 0, st>>>(qkv, tokens, hq, hkv, qw, kw,
                                                                        1e-6f, qk);
                    unfused_rope<<<blocks_for_warps(nqk), 256, 0, st>>>(qk, tokens, hq + hkv, pos,
                                                                        cos_t, sin_t, qk2);
                    unfused_q_quant<<<blocks_for_warps(nq), 256, 0, st>>>(qk2, tokens, hq, hkv, q8, qs);
                    unfused_kv_quant<<<blocks_for_warps(nkv), 256, 0, st>>>(qk2, qkv, tokens, hq, hkv,
                                                                            inv_k, inv_v, kv8);
                    unfused_store<<<blocks_for_warps(nkv), 256, 0, st>>>(
                        kv8, tokens, hkv, slots, pool, (long long)lay->block_stride,
                        (long long)lay->token_stride, (long long)lay->v_offset);
                    CHECK(cudaGetLastError());
                },
                s);
            res.bytes = (double)tokens * ((hq + 2 * hkv) * kD * 2 + 4 + 8) +
                        (double)tokens * (hq * kD + hq * 4 + 2 * hkv * kD);
            res.anchor = anchor_us(tokens, hq);
            results.push_back(res);
        }

    fprintf(table, "prologue_bench on %s: HBM copy rate %.0f GB/s (1 GiB D2D, read+write)\n",
            prop.name, copy_rate / 1e9);
    fprintf(table, "%7s %6s %9s %9s %8s %9s %8s %8s  %s\n", "tokens", "heads", "fused_us",
            "anchor_us", "vs_anch", "unfused", "speedup", "hbm_frac",
            "1/2/persistent/walk/ring/prefetch/fixed/walkfixed us");
    for (auto &r : results) {
        double frac = r.bytes / (r.fused_us * 1e-6) / copy_rate;
        fprintf(table,
                "%7d %3d/%-2d %9.2f %9.1f %7.2fx %9.2f %7.2fx %8.3f  %.2f/%.2f/%.2f/%.2f/%.2f/%.2f/%.2f/%.2f\n",
                r.tokens, r.hq, r.hkv, r.fused_us, r.anchor, r.anchor / r.fused_us, r.unfused_us,
                r.unfused_us / r.fused_us, frac, r.items_us[0], r.items_us[1], r.items_us[2],
                r.items_us[3], r.items_us[4], r.items_us[5], r.items_us[6], r.items_us[7]);
    }
    if (json) {
        printf("[\n");
        for (size_t i = 0; i < results.size(); i++) {
            const Result &r = results[i];
            double frac = r.bytes / (r.fused_us * 1e-6) / copy_rate;
            printf("  {\"bench\": \"prologue\", \"gpu\": \"%s\", \"tokens\": %d, \"hq\": %d, \"hkv\": %d, "
                   "\"head_dim\": %d, \"page_tokens\": %d, \"fused_us\": %.3f, \"unfused_us\": %.3f, "
                   "\"speedup\": %.3f, \"bytes\": %.0f, \"hbm_copy_gbps\": %.1f, \"hbm_fraction\": %.4f, "
                   "\"anchor_us\": %.1f, \"vs_anchor\": %.3f, \"items1_us\": %.3f, \"items2_us\": %.3f, "
                   "\"persistent_us\": %.3f, \"walk_us\": %.3f, \"persistent2_us\": %.3f, "
                   "\"persistent_pf_us\": %.3f, \"persistent_fixed_us\": %.3f, \"walk_fixed_us\": %.3f}%s\n",
                   prop.name, r.tokens, r.hq, r.hkv, kD, kP, r.fused_us, r.unfused_us,
                   r.unfused_us / r.fused_us, r.bytes, copy_rate / 1e9, frac, r.anchor,
                   r.anchor / r.fused_us, r.items_us[0], r.items_us[1], r.items_us[2],
                   r.items_us[3], r.items_us[4], r.items_us[5], r.items_us[6], r.items_us[7],
                   i + 1 < results.size() ? "," : "");
        }
        printf("]\n");
    }
    cudaFree(qkv); cudaFree(qk); cudaFree(qk2); cudaFree(q8); cudaFree(kv8); cudaFree(qs);
    cudaFree(cos_t); cudaFree(sin_t); cudaFree(qw); cudaFree(kw); cudaFree(pos); cudaFree(slots);
    cudaFree(last); cudaFree(pool);
    CHECK(cudaStreamDestroy(s));
    return 0;
}

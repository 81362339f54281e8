/* decode_bench.cu - dynamic-split vs static split-KV decode attention (kernels/decode.cu) on
 * the paged FP8 pool, with HPC-Ops (where built in, bench/decode_hpcops.h) timed beside them on
 * the same inputs, and the HBM copy and read rates of the same run.
 *
 * Shapes (issue 5): head dim 128, 64 tokens per page, FP8 KV with per-tensor scales, FP8 Q
 * with per-token-per-head scales; Hq/Hkv = 8/1 and 64/8; query lengths 1, 2, 3, 4, 5 and 8
 * (HPC-Ops runs 1..4); the KV-length cases below. Inputs are random (never zeros) and the same for dynamic and static.
 *
 * Method: one attention call (attention + combine; the plan computed before) captured in a
 * CUDA graph; 5 warm-up replays; 50 replays, each between its own pair of CUDA events; the
 * median. Dynamic, static, HPC-Ops and (past 8 rows) the warpgroup kernel (wg_us, its own
 * plan: TKVK__DEC_WG) take turns in five blocks of 5 warm-up and 10 timed replays each
 * (a clock drift favours neither; each block replays one graph, as the method has it).
 * Again with L2 flushed (a 256 MiB memset between replays, outside the events). The plan
 * alone and plan + attention + combine are timed the same way. hbm_fraction = KV bytes /
 * dynamic time / copy rate, where the copy rate is a 1 GiB device-to-device cudaMemcpy
 * (bytes read + written) measured in the same run.
 *
 * Also timed: the dynamic step through the CTA kernel (what the launcher used before the
 * warp-worker kernel), through the warp-worker kernel's other layouts (at most 8 rows: rows
 * on the mma's M side, m16_us; 17..32 rows: one warp per worker, one_us), and with floors of
 * 1, 2, 4 and 8 tiles per worker (or, with --combine, with the launcher's combine shape and
 * 16 warps per row over 1, 2 and 4 slices of the head dim, static timed beside it with the
 * same shape; with --warps, 8, 4, 2 and 1 warps per CTA, 8 per SM).
 *
 * Usage: decode_bench [--json] [--peer FILE] [--quick] [--combine | --warps] [--values a,b,c,d]
 *                     [--case NAME] [--hq N] [--qlens a,b,...] [--lean] [--public]
 *                     [--wg-forms a,b,...]
 *   --json   print a JSON list of result objects on stdout (the table goes to stderr)
 *   --peer   FILE: JSON from bench/flashinfer_decode.py; its flashinfer_us joins the rows
 *   --quick  fewer replays (smoke runs)
 *   --values the sweep's four settings instead of its defaults (floors; with --combine,
 *            K + 100 S, 0 for the launcher's choice; with --warps, warps per CTA)
 *   --case, --hq, --qlens  run only the matching rows (profiling)
 *   --lean   only dynamic, static and HPC-Ops (no flushed replays, sweeps or other kernels)
 *   --public only the nine public cases
 *   --wg-forms  time the warpgroup kernel (at every row count, not only past 8) in each of
 *            these forms (tkvk__decode_wg_form: 2, 3, 4 stages, 12, 13, 22, 32, 34; 0 the
 *            launcher's choice), each with its own plan, instead of only the launcher's; form
 *            1 is the launcher's choice without the warpgroup kernel (TKVK__DEC_LEGACY: the
 *            warp-worker kernel up to 32 rows), timed in the same turns
 * Exit 77 when no GPU is present.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include "decode_internal.h"
#include "tkv_kernels.h"
#include "decode_static.h"
#ifdef TKV_HAVE_HPCOPS
#include "decode_hpcops.h"
#endif

#define CK(call)                                                                                 \
    do {                                                                                         \
        cudaError_t e_ = (call);                                                                 \
        if (e_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "decode_bench: %s:%d %s: %s\n", __FILE__, __LINE__, #call,            \
                    cudaGetErrorString(e_));                                                     \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)
#define TK(call)                                                                                 \
    do {                                                                                         \
        int r_ = (call);                                                                         \
        if (r_ != TKVK_OK) {                                                                     \
            fprintf(stderr, "decode_bench: %s:%d %s: %s (%s)\n", __FILE__, __LINE__, #call,       \
                    tkvk_strerror(r_), tkvk_last_error());                                       \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

struct Part {
    int count, len;
};
struct BenchCase {
    const char *name;
    std::vector<Part> parts;
};

/* The nine public cases, then mixes of our own: many short requests, one huge one beside
 * tiny ones, and lengths that are not a multiple of the page. */
static const BenchCase kCases[] = {
    {"64x512", {{64, 512}}},
    {"64x4096", {{64, 4096}}},
    {"32x128+32x4096", {{32, 128}, {32, 4096}}},
    {"15x64+1x16384", {{15, 64}, {1, 16384}}},
    {"1x65536+7x4096", {{1, 65536}, {7, 4096}}},
    {"1x65536+15x4096", {{1, 65536}, {15, 4096}}},
    {"1x65536+31x4096", {{1, 65536}, {31, 4096}}},
    {"1x131072+31x4096", {{1, 131072}, {31, 4096}}},
    {"2x32768+30x4096", {{2, 32768}, {30, 4096}}},
    {"256x333", {{256, 333}}},
    {"1x200003+63x97", {{1, 200003}, {63, 97}}},
    {"7x4097+9x1023+16x257", {{7, 4097}, {9, 1023}, {16, 257}}},
};
static const int kPublicCases = 9;

static uint64_t g_rng = 0x1234567u;
static uint32_t rnd32(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)g_rng;
}

static int g_reps = 50, g_warm = 5;
static bool g_lean; /* --lean: no flushed replays, no sweeps, no other kernels */
/* The last four columns: the dynamic step with each of these floors (tiles per worker); with
 * --combine each of these combine shapes (tkvk__decode_tune: 0 the launcher's choice, K warps
 * per row over S slices of the head dim: K + 100 S); with --warps each of these numbers of
 * warp workers per CTA of the warp-worker kernel (8 per SM in all). */
enum { SWEEP_FLOORS, SWEEP_COMBINE, SWEEP_WARPS };
static int g_sweep = SWEEP_FLOORS;
static const int kSweep[3][4] = {{1, 2, 4, 8}, {0, 116, 216, 416}, {8, 4, 2, 1}};
static const char *const kSweepLabel[3] = {"floor 1/2/4/8 us", "combine auto/16x1/16x2/16x4 us",
                                           "warps/CTA 8/4/2/1 us"};
static const char *const kSweepKey[3] = {"dynamic_floor_us", "dynamic_combine_us",
                                         "dynamic_cta_warps_us"};

/* --wg-forms a,b,...: the warpgroup kernel's forms timed (tkvk__decode_wg_form; 0: the
 * launcher's choice), each with its own plan, in the same turns as the rest */
static int g_wg_list[5] = {0, 0, 0, 0, 0};
static int g_wg_n = 1;

static int g_values[4]; /* --values: the sweep's four settings instead of kSweep's */
static bool g_values_set;
static const int *sweep_values(void)
{
    return g_values_set ? g_values : kSweep[g_sweep];
}
static void *g_flush;
static const size_t kFlushBytes = (size_t)256 << 20;

/* Medians (us) of g_reps replays of each of n graphs, each replay between its own events;
 * flush: L2 wiped before each. The graphs take turns in blocks: each block is g_warm warm-up
 * replays and then consecutive timed replays of one graph (so that it finds the L2 as its own
 * previous replay left it, as the peers' benchmarks have it), and a clock drift during the
 * measurement favours none of the graphs. */
static void time_graphs(const cudaGraphExec_t *exec, int n, cudaStream_t s, bool flush,
                        double *us)
{
    const int blocks = g_reps >= 25 ? 5 : 1;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<std::vector<float>> ms(n);
    for (int blk = 0; blk < blocks; blk++)
        for (int k = 0; k < n; k++) {
            for (int i = 0; i < g_warm; i++)
                CK(cudaGraphLaunch(exec[k], s));
            const int reps = g_reps / blocks + (blk < g_reps % blocks);
            for (int i = 0; i < reps; i++) {
                if (flush)
                    CK(cudaMemsetAsync(g_flush, i & 0xff, kFlushBytes, s));
                CK(cudaEventRecord(a, s));
                CK(cudaGraphLaunch(exec[k], s));
                CK(cudaEventRecord(b, s));
                CK(cudaEventSynchronize(b));
                float t;
                CK(cudaEventElapsedTime(&t, a, b));
                ms[k].push_back(t);
            }
        }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    for (int k = 0; k < n; k++) {
        std::sort(ms[k].begin(), ms[k].end());
        us[k] = 1000.0 * ms[k][ms[k].size() / 2];
    }
}

static double time_graph(cudaGraphExec_t exec, cudaStream_t s, bool flush)
{
    double us;
    time_graphs(&exec, 1, s, flush, &us);
    return us;
}

/* Bytes read + written per second by a large device-to-device copy. */
static double copy_rate(cudaStream_t s)
{
    size_t n = (size_t)1 << 30;
    void *x, *y;
    CK(cudaMalloc(&x, n));
    CK(cudaMalloc(&y, n));
    CK(cudaMemset(x, 1, n));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> ms(10);
    for (int i = 0; i < 13; i++) {
        CK(cudaEventRecord(a, s));
        CK(cudaMemcpyAsync(y, x, n, cudaMemcpyDeviceToDevice, s));
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        if (i >= 3)
            CK(cudaEventElapsedTime(&ms[i - 3], a, b));
    }
    std::sort(ms.begin(), ms.end());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    CK(cudaFree(x));
    CK(cudaFree(y));
    return 2.0 * (double)n / (ms[5] * 1e-3);
}

/* Bytes read per second by a read-only kernel over 4 GiB (16-byte loads, a persistent grid):
 * the ceiling of a kernel that only reads, such as attention over a KV cache. */
__global__ void read_kernel(const uint4 *p, size_t n, unsigned *sink)
{
    uint32_t x = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(p + i);
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x9e3779b9u)
        *sink = x; /* never in practice: keeps the loads */
}
static double read_rate(cudaStream_t s)
{
    size_t n = (size_t)4 << 30;
    void *x;
    unsigned *sink;
    CK(cudaMalloc(&x, n));
    CK(cudaMalloc((void **)&sink, 4));
    CK(cudaMemset(x, 1, n));
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> ms(10);
    for (int i = 0; i < 13; i++) {
        CK(cudaEventRecord(a, s));
        read_kernel<<<sms * 8, 512, 0, s>>>((const uint4 *)x, n / 16, sink);
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        if (i >= 3)
            CK(cudaEventElapsedTime(&ms[i - 3], a, b));
    }
    std::sort(ms.begin(), ms.end());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    CK(cudaFree(x));
    CK(cudaFree(sink));
    return (double)n / (ms[5] * 1e-3);
}

struct Row {
    std::string name;
    int hq, hkv, q_len;
    double kv_bytes, dyn, stat, dyn_flushed, stat_flushed, plan, step, hbm_fraction;
    double hpc;      /* HPC-Ops, same inputs, same turns; < 0: not run */
    double hpc_diff; /* relative L2 distance of its O from ours */
    double hbm_read_fraction;
    double max_diff;
    double cta;          /* dynamic through the CTA kernel (the warp-worker kernel off) */
    double m16;          /* at most 8 rows: the warp-worker kernel with rows on the mma's M side */
    double one;          /* 17..32 rows: the warp-worker kernel with one warp per worker */
    double wg;           /* past 8 rows: the warpgroup kernel (TKVK__DEC_WG), its own plan */
    double wgs[5];       /* --wg-forms: the warpgroup kernel in each of g_wg_list (wgs[0] = wg) */
    double wg_diff;      /* largest |O| difference of the warpgroup kernel (every stage count)
                            from the dynamic step's */
    double sweep_us[4];  /* dynamic at each of sweep_values() */
    double sweep_static_us[4]; /* --combine: static at each of them (side by side), else -1 */
    int splits;
    double peer; /* < 0: none */
};

/* peer JSON: a list of {"case":..., "hq":..., "hkv":..., "q_len":..., "flashinfer_us": x} */
static double peer_lookup(const std::string &json, const Row &r)
{
    if (json.empty())
        return -1;
    char key[256];
    snprintf(key, sizeof key, "\"case\": \"%s\", \"hq\": %d, \"hkv\": %d, \"q_len\": %d",
             r.name.c_str(), r.hq, r.hkv, r.q_len);
    size_t at = json.find(key);
    if (at == std::string::npos)
        return -1;
    size_t f = json.find("\"flashinfer_us\":", at);
    size_t end = json.find('}', at);
    if (f == std::string::npos || f > end)
        return -1;
    const char *v = json.c_str() + f + strlen("\"flashinfer_us\":");
    while (*v == ' ')
        v++;
    if (!strncmp(v, "null", 4))
        return -1;
    return strtod(v, NULL);
}

static Row run(const BenchCase &bc, int hq, int hkv, int q_len, cudaStream_t s)
{
    const int D = 128, P = 64;
    std::vector<int32_t> lens;
    for (const Part &p : bc.parts)
        for (int i = 0; i < p.count; i++)
            lens.push_back(p.len);
    int nreq = (int)lens.size();
    int32_t max_len = 0;
    int total_blocks = 0, max_blocks = 0;
    double kv_bytes = 0;
    for (int32_t L : lens) {
        max_len = std::max(max_len, L);
        int b = (L + P - 1) / P;
        total_blocks += b;
        max_blocks = std::max(max_blocks, b);
        kv_bytes += 2.0 * L * hkv * D; /* K and V, one byte each */
    }
    tkvk_layout lay;
    TK(tkvk_layout_init(&lay, 1, hkv, D, P, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR));
    size_t pool_bytes = (size_t)total_blocks * lay.block_stride;
    /* random bytes that are finite e4m3 codes (0x7f/0xff are NaN) */
    std::vector<uint8_t> host_pool(pool_bytes);
    for (size_t i = 0; i + 8 <= pool_bytes; i += 8) {
        /* exponent field < 15: |x| < 256, no NaN */
        uint64_t v = ((uint64_t)rnd32() << 32 | rnd32()) & 0xf7f7f7f7f7f7f7f7ull;
        memcpy(&host_pool[i], &v, 8);
    }
    std::vector<int32_t> ids(total_blocks);
    for (int i = 0; i < total_blocks; i++)
        ids[i] = i;
    for (int i = total_blocks - 1; i > 0; i--)
        std::swap(ids[i], ids[rnd32() % (uint32_t)(i + 1)]);
    std::vector<int32_t> table((size_t)nreq * max_blocks, 0);
    int next = 0;
    for (int r = 0; r < nreq; r++)
        for (int b = 0; b < (lens[r] + P - 1) / P; b++) {
            const int id = ids[next++];
            table[(size_t)r * max_blocks + b] = id;
            /* the tail of a request's last page is zero (HPC-Ops requires it; ours never
             * reads it) */
            for (int t = lens[r] - b * P; t < P; t++) {
                uint8_t *row = &host_pool[(size_t)id * lay.block_stride + t * lay.token_stride];
                memset(row, 0, lay.token_stride);
                memset(row + lay.v_offset, 0, lay.token_stride);
            }
        }
    size_t qn = (size_t)nreq * q_len * hq * D;
    std::vector<uint8_t> q(qn);
    for (size_t i = 0; i < qn; i++)
        q[i] = (uint8_t)(rnd32() & 0xb7); /* small finite codes */
    std::vector<float> qs((size_t)nreq * q_len * hq);
    for (size_t i = 0; i < qs.size(); i++)
        qs[i] = 0.01f + 0.001f * (float)(rnd32() % 10);

    uint8_t *d_pool, *d_q;
    int32_t *d_table, *d_lens;
    float *d_qs, *d_lse;
    uint16_t *d_out, *d_out2;
    CK(cudaMalloc((void **)&d_pool, pool_bytes));
    CK(cudaMemcpy(d_pool, host_pool.data(), pool_bytes, cudaMemcpyHostToDevice));
    CK(cudaMalloc((void **)&d_table, table.size() * 4));
    CK(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc((void **)&d_lens, nreq * 4));
    CK(cudaMemcpy(d_lens, lens.data(), nreq * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc((void **)&d_q, qn));
    CK(cudaMemcpy(d_q, q.data(), qn, cudaMemcpyHostToDevice));
    CK(cudaMalloc((void **)&d_qs, qs.size() * 4));
    CK(cudaMemcpy(d_qs, qs.data(), qs.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc((void **)&d_out, qn * 2));
    CK(cudaMalloc((void **)&d_out2, qn * 2));
    CK(cudaMalloc((void **)&d_lse, qs.size() * 4));

    tkvk_decode_args a;
    memset(&a, 0, sizeof a);
    a.layout = &lay;
    a.layer = 0;
    a.num_requests = nreq;
    a.num_q_heads = hq;
    a.q_len = q_len;
    a.q_dtype = TKVK_DTYPE_FP8_E4M3;
    a.q = d_q;
    a.q_scales = d_qs;
    a.kv_lens = d_lens;
    a.block_table = d_table;
    a.block_table_stride = max_blocks;
    a.num_blocks = total_blocks;
    a.pool = d_pool;
    a.k_scale = 0.02f;
    a.v_scale = 0.03f;
    a.sm_scale = 1.0f / sqrtf((float)D);
    a.out = d_out;
    a.lse = d_lse;

    tkvk_decode_plan *plan;
    TK(tkvk_decode_plan_create(&plan, nreq, hkv, (hq / hkv) * q_len, D));

    Row row;
    row.name = bc.name;
    row.hq = hq;
    row.hkv = hkv;
    row.q_len = q_len;
    row.kv_bytes = kv_bytes;
    row.splits = 0;
    row.hpc = -1;
    row.hpc_diff = -1;

    cudaGraph_t g;
    cudaGraphExec_t plan_exec, dyn_exec, stat_exec, step_exec;
    /* plan alone */
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    TK(tkvk_decode_plan_cuda(plan, d_lens, nreq, s));
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&plan_exec, g, 0));
    CK(cudaGraphDestroy(g));
    CK(cudaGraphLaunch(plan_exec, s)); /* the task map the attention graph reads */
    CK(cudaStreamSynchronize(s));
    /* attention + combine (the launcher picks the combine when the graph is captured) */
    auto attend_graph = [&]() {
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        TK(tkvk_decode_attend_cuda(plan, &a, s));
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&exec, g, 0));
        CK(cudaGraphDestroy(g));
        return exec;
    };
    dyn_exec = attend_graph();
    /* static */
    tkvk_decode_args as = a;
    as.out = d_out2;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    TK(tkvk_decode_static_cuda(plan, &as, max_len, 0, s));
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&stat_exec, g, 0));
    CK(cudaGraphDestroy(g));
    /* plan + attention + combine */
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    TK(tkvk_decode_plan_cuda(plan, d_lens, nreq, s));
    TK(tkvk_decode_attend_cuda(plan, &a, s));
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&step_exec, g, 0));
    CK(cudaGraphDestroy(g));

    /* HPC-Ops on the same pool, queries and table, into its own output */
    cudaGraphExec_t hpc_exec = nullptr;
    uint16_t *d_out3 = nullptr;
#ifdef TKV_HAVE_HPCOPS
    hpcops_decode *hpc = nullptr;
    if (hpcops_decode_supported(hq / hkv, q_len)) {
        CK(cudaMalloc((void **)&d_out3, qn * 2));
        hpcops_decode_args ha = {nreq,       q_len,        hq,       hkv,
                                 d_lens,     max_len,      d_table,  max_blocks,
                                 total_blocks, d_q,        d_qs,     d_pool,
                                 d_pool + lay.v_offset,    (int64_t)lay.block_stride,
                                 (int64_t)lay.token_stride, (int64_t)D * 1,
                                 a.k_scale,  a.v_scale,    d_out3};
        hpc = hpcops_decode_create(&ha, s);
        if (hpc) {
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            const int rc = hpcops_decode_run(hpc, s);
            CK(cudaStreamEndCapture(s, &g));
            if (rc == 0) {
                CK(cudaGraphInstantiate(&hpc_exec, g, 0));
            } else {
                fprintf(stderr, "decode_bench: HPC-Ops launch failed (%s)\n", bc.name);
            }
            CK(cudaGraphDestroy(g));
        } else {
            fprintf(stderr, "decode_bench: HPC-Ops not run on %s %d/%d q_len %d (setup refused)\n",
                    bc.name, hq, hkv, q_len);
        }
    }
#endif
    /* past 8 rows (with --wg-forms, at every row count): the warpgroup kernel (its own plan;
     * with --wg-forms in each of them), timed in the same turns as the rest */
    tkvk_decode_plan *wg_plan[5] = {};
    cudaGraphExec_t wg_exec[5] = {};
    uint16_t *d_out4 = nullptr;
    row.wg = -1;
    row.wg_diff = -1;
    for (int k = 0; k < 5; k++)
        row.wgs[k] = -1;
    const bool wg_on = (hq / hkv) * q_len > 8 || g_wg_n > 1;
    if (wg_on) {
        CK(cudaMalloc((void **)&d_out4, qn * 2 * g_wg_n));
        for (int k = 0; k < g_wg_n; k++) {
            tkvk__decode_kernel(g_wg_list[k] == 1 ? TKVK__DEC_LEGACY : TKVK__DEC_WG);
            tkvk__decode_wg_form(g_wg_list[k]);
            TK(tkvk_decode_plan_create(&wg_plan[k], nreq, hkv, (hq / hkv) * q_len, D));
            TK(tkvk_decode_plan_cuda(wg_plan[k], d_lens, nreq, s));
            CK(cudaStreamSynchronize(s));
            tkvk_decode_args ao = a;
            ao.out = d_out4 + qn * k;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            TK(tkvk_decode_attend_cuda(wg_plan[k], &ao, s));
            CK(cudaStreamEndCapture(s, &g));
            CK(cudaGraphInstantiate(&wg_exec[k], g, 0));
            CK(cudaGraphDestroy(g));
        }
        tkvk__decode_wg_form(0);
        tkvk__decode_kernel(TKVK__DEC_AUTO);
    }
    /* dynamic, static, HPC-Ops and the warpgroup kernel side by side, block by block */
    cudaGraphExec_t trio[8] = {dyn_exec, stat_exec};
    int ntrio = 2, at_hpc = -1, at_wg = -1;
    if (hpc_exec) {
        at_hpc = ntrio;
        trio[ntrio++] = hpc_exec;
    }
    if (wg_on) {
        at_wg = ntrio;
        for (int k = 0; k < g_wg_n; k++)
            trio[ntrio++] = wg_exec[k];
    }
    double t[8];
    time_graphs(trio, ntrio, s, false, t);
    row.dyn = t[0];
    row.stat = t[1];
    if (at_hpc >= 0)
        row.hpc = t[at_hpc];
    if (at_wg >= 0) {
        for (int k = 0; k < g_wg_n; k++) {
            row.wgs[k] = t[at_wg + k];
            CK(cudaGraphExecDestroy(wg_exec[k]));
            tkvk_decode_plan_destroy(wg_plan[k]);
        }
        row.wg = row.wgs[0];
    }
    row.dyn_flushed = row.stat_flushed = -1;
    if (!g_lean) {
        time_graphs(trio, 2, s, true, t);
        row.dyn_flushed = t[0];
        row.stat_flushed = t[1];
    }
    row.plan = time_graph(plan_exec, s, false);
    row.step = time_graph(step_exec, s, false);

    /* the CTA kernel (or another setting), with its own plan (the grid follows the kernel's
     * occupancy); its output goes to d_out2 */
    auto time_kernel = [&](int which, int warps) {
        tkvk__decode_kernel(which);
        tkvk__decode_cta_warps(warps);
        tkvk_decode_plan *kp;
        cudaGraphExec_t kexec;
        TK(tkvk_decode_plan_create(&kp, nreq, hkv, (hq / hkv) * q_len, D));
        TK(tkvk_decode_plan_cuda(kp, d_lens, nreq, s));
        CK(cudaStreamSynchronize(s));
        tkvk_decode_args ak = a;
        ak.out = d_out2;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        TK(tkvk_decode_attend_cuda(kp, &ak, s));
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&kexec, g, 0));
        CK(cudaGraphDestroy(g));
        double us = time_graph(kexec, s, false);
        CK(cudaGraphExecDestroy(kexec));
        tkvk_decode_plan_destroy(kp);
        tkvk__decode_kernel(TKVK__DEC_AUTO);
        tkvk__decode_cta_warps(0);
        return us;
    };
    /* floors: re-plan outside the graph, which reads whatever map is there; combine: a new
     * graph for each choice; warps: a new plan for each */
    for (int f = 0; f < 4; f++) {
        const int v = sweep_values()[f];
        row.sweep_static_us[f] = -1;
        row.sweep_us[f] = -1;
        if (g_lean)
            continue;
        if (g_sweep == SWEEP_COMBINE) {
            /* dynamic and static with the same combine shape, side by side */
            tkvk__decode_tune(v);
            cudaGraphExec_t ex[2] = {attend_graph(), nullptr};
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            TK(tkvk_decode_static_cuda(plan, &as, max_len, 0, s));
            CK(cudaStreamEndCapture(s, &g));
            CK(cudaGraphInstantiate(&ex[1], g, 0));
            CK(cudaGraphDestroy(g));
            time_graphs(ex, 2, s, false, t);
            row.sweep_us[f] = t[0];
            row.sweep_static_us[f] = t[1];
            CK(cudaGraphExecDestroy(ex[0]));
            CK(cudaGraphExecDestroy(ex[1]));
        } else if (g_sweep == SWEEP_WARPS) {
            row.sweep_us[f] = time_kernel(TKVK__DEC_AUTO, v);
        } else {
            TK(tkvk_decode_plan_set_min_tiles(plan, v));
            TK(tkvk_decode_plan_cuda(plan, d_lens, nreq, s));
            CK(cudaStreamSynchronize(s));
            row.sweep_us[f] = time_graph(dyn_exec, s, false);
        }
    }
    tkvk__decode_tune(0);
    row.m16 = !g_lean && (hq / hkv) * q_len <= 8 ? time_kernel(TKVK__DEC_WARP_M16, 0) : -1;
    row.one = !g_lean && (hq / hkv) * q_len > 16 ? time_kernel(TKVK__DEC_WARP_ONE, 0) : -1;
    row.cta = -1;
    /* dynamic, static and the CTA kernel must agree (all replayed on the same inputs) */
    std::vector<uint16_t> o_cta(qn);
    if (!g_lean) {
        row.cta = time_kernel(TKVK__DEC_CTA, 0);
        CK(cudaMemcpy(o_cta.data(), d_out2, qn * 2, cudaMemcpyDeviceToHost));
    }
    CK(cudaGraphLaunch(stat_exec, s));
    CK(cudaStreamSynchronize(s));
    std::vector<uint16_t> o1(qn), o2(qn);
    CK(cudaMemcpy(o1.data(), d_out, qn * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o2.data(), d_out2, qn * 2, cudaMemcpyDeviceToHost));
    double md = 0;
    for (size_t i = 0; i < qn; i++) {
        double x = tkvk_bf16_to_float(o1[i]), y = tkvk_bf16_to_float(o2[i]);
        double e = fabs(x - y);
        if (!g_lean)
            e = fmax(e, fabs(x - tkvk_bf16_to_float(o_cta[i])));
        if (!(e <= md))
            md = isnan(e) ? INFINITY : e;
    }
    row.max_diff = md;
    if (wg_on) {
        std::vector<uint16_t> o4(qn * g_wg_n);
        CK(cudaMemcpy(o4.data(), d_out4, qn * 2 * g_wg_n, cudaMemcpyDeviceToHost));
        double wd = 0;
        for (size_t i = 0; i < qn * g_wg_n; i++) {
            double e = fabs(tkvk_bf16_to_float(o1[i % qn]) - tkvk_bf16_to_float(o4[i]));
            if (!(e <= wd))
                wd = isnan(e) ? INFINITY : e;
        }
        row.wg_diff = wd;
    }
    cudaFree(d_out4);
    if (hpc_exec) {
        /* HPC-Ops rounds P to e4m3, so it differs from us by more than a bf16 step: the
         * relative L2 distance says whether it computed the same attention */
        std::vector<uint16_t> o3(qn);
        CK(cudaGraphLaunch(hpc_exec, s));
        CK(cudaStreamSynchronize(s));
        CK(cudaMemcpy(o3.data(), d_out3, qn * 2, cudaMemcpyDeviceToHost));
        double num = 0, den = 0;
        for (size_t i = 0; i < qn; i++) {
            double x = tkvk_bf16_to_float(o1[i]), y = tkvk_bf16_to_float(o3[i]);
            num += (x - y) * (x - y);
            den += x * x;
        }
        row.hpc_diff = den > 0 ? sqrt(num / den) : (num > 0 ? INFINITY : 0);
        if (isnan(row.hpc_diff))
            row.hpc_diff = INFINITY;
        CK(cudaGraphExecDestroy(hpc_exec));
    }
#ifdef TKV_HAVE_HPCOPS
    hpcops_decode_destroy(hpc);
#endif
    cudaFree(d_out3);

    CK(cudaGraphExecDestroy(plan_exec));
    CK(cudaGraphExecDestroy(dyn_exec));
    CK(cudaGraphExecDestroy(stat_exec));
    CK(cudaGraphExecDestroy(step_exec));
    tkvk_decode_plan_destroy(plan);
    cudaFree(d_pool);
    cudaFree(d_table);
    cudaFree(d_lens);
    cudaFree(d_q);
    cudaFree(d_qs);
    cudaFree(d_out);
    cudaFree(d_out2);
    cudaFree(d_lse);
    return row;
}

int main(int argc, char **argv)
{
    bool json = false;
    std::string peer;
    const char *only_case = NULL;
    int only_hq = 0;
    bool public_only = false;
    std::vector<int> qlens = {1, 2, 3, 4, 5, 8};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            json = true;
        else if (!strcmp(argv[i], "--case") && i + 1 < argc)
            only_case = argv[++i];
        else if (!strcmp(argv[i], "--hq") && i + 1 < argc)
            only_hq = atoi(argv[++i]);
        else if ((!strcmp(argv[i], "--qlen") || !strcmp(argv[i], "--qlens")) && i + 1 < argc) {
            qlens.clear();
            for (const char *c = argv[++i]; *c;) {
                char *e;
                long v = strtol(c, &e, 10);
                if (e == c || v < 1 || v > 8) {
                    fprintf(stderr, "decode_bench: --qlens takes query lengths 1..8, a,b,...\n");
                    return 2;
                }
                qlens.push_back((int)v);
                c = *e == ',' ? e + 1 : e;
            }
        } else if (!strcmp(argv[i], "--lean"))
            g_lean = true;
        else if (!strcmp(argv[i], "--public"))
            public_only = true;
        else if (!strcmp(argv[i], "--combine"))
            g_sweep = SWEEP_COMBINE;
        else if (!strcmp(argv[i], "--warps"))
            g_sweep = SWEEP_WARPS;
        else if (!strcmp(argv[i], "--values") && i + 1 < argc) {
            if (sscanf(argv[++i], "%d,%d,%d,%d", &g_values[0], &g_values[1], &g_values[2],
                       &g_values[3]) != 4) {
                fprintf(stderr, "decode_bench: --values takes four integers, a,b,c,d\n");
                return 2;
            }
            g_values_set = true;
        }
        else if (!strcmp(argv[i], "--wg-forms") && i + 1 < argc) {
            g_wg_n = sscanf(argv[++i], "%d,%d,%d,%d,%d", &g_wg_list[0], &g_wg_list[1],
                            &g_wg_list[2], &g_wg_list[3], &g_wg_list[4]);
            if (g_wg_n < 1) {
                fprintf(stderr, "decode_bench: --wg-forms takes 1-5 forms, a,b,...\n");
                return 2;
            }
        } else if (!strcmp(argv[i], "--quick")) {
            g_reps = 11;
            g_warm = 2;
        } else if (!strcmp(argv[i], "--peer") && i + 1 < argc) {
            FILE *f = fopen(argv[++i], "r");
            if (!f) {
                fprintf(stderr, "decode_bench: cannot read %s\n", argv[i]);
                return 2;
            }
            char buf[4096];
            size_t n;
            while ((n = fread(buf, 1, sizeof buf, f)) > 0)
                peer.append(buf, n);
            fclose(f);
        } else {
            fprintf(stderr, "usage: decode_bench [--json] [--peer FILE] [--quick] "
                            "[--combine | --warps] [--values a,b,c,d] [--case NAME] [--hq N] "
                            "[--qlens a,b,...] [--lean] [--public]\n");
            return 2;
        }
    }
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        fprintf(stderr, "decode_bench: no GPU, skipped\n");
        return 77;
    }
    FILE *tab = json ? stderr : stdout;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMalloc(&g_flush, kFlushBytes));
    double rate = copy_rate(s);
    fprintf(tab, "# %s, %d SMs, L2 %d MiB; HBM copy rate %.0f GB/s (read+write)\n", prop.name,
            prop.multiProcessorCount, prop.l2CacheSize >> 20, rate / 1e9);
    fprintf(tab,
            "# D 128, P 64, FP8 KV per-tensor, FP8 Q per-token-head; us = median of %d graph "
            "replays\n",
            g_reps);
    double rrate = read_rate(s);
    fprintf(tab, "# HBM read rate %.0f GB/s (a read-only kernel over 4 GiB)%s\n", rrate / 1e9,
#ifdef TKV_HAVE_HPCOPS
            "; HPC-Ops built in (hpc_us)"
#else
            "; HPC-Ops not built in"
#endif
    );
    char label[64];
    if (g_values_set)
        snprintf(label, sizeof label, "%s %d/%d/%d/%d", kSweepKey[g_sweep], g_values[0],
                 g_values[1], g_values[2], g_values[3]);
    fprintf(tab,
            "%-20s %5s %2s %8s %8s %8s %8s %8s %5s %5s %6s %8s %6s %7s %6s %6s %8s %8s %6s %8s %8s "
            "%8s %27s\n",
            "case", "heads", "q", "dyn_us", "stat_us", "dynL2f", "plan_us", "step_us", "hbm",
            "hbmrd", "xstat", "hpc_us", "xhpc", "hpcdiff", "fi_us", "xfi", "maxdiff", "wg_us",
            "xwg", "cta_us",
            "m16_us", "one_us", g_values_set ? label : kSweepLabel[g_sweep]);
    std::vector<Row> rows;
    const int heads[2][2] = {{8, 1}, {64, 8}};
    for (int q_len : qlens)
        for (int hi = 0; hi < 2; hi++)
            for (int ci = 0; ci < (int)(sizeof kCases / sizeof kCases[0]); ci++) {
                const BenchCase &bc = kCases[ci];
                if ((only_case && strcmp(only_case, bc.name)) ||
                    (only_hq && only_hq != heads[hi][0]) || (public_only && ci >= kPublicCases))
                    continue;
                Row r = run(bc, heads[hi][0], heads[hi][1], q_len, s);
                r.hbm_fraction = r.kv_bytes / (r.dyn * 1e-6) / rate;
                r.hbm_read_fraction = r.kv_bytes / (r.dyn * 1e-6) / rrate;
                r.peer = peer_lookup(peer, r);
                char heads_s[8], hpc_s[16], xh_s[16], hd_s[16], fi_s[16], xfi_s[16];
                snprintf(heads_s, sizeof heads_s, "%d/%d", r.hq, r.hkv);
                snprintf(hpc_s, sizeof hpc_s, r.hpc > 0 ? "%.1f" : "-", r.hpc);
                snprintf(xh_s, sizeof xh_s, r.hpc > 0 ? "%.2f" : "-", r.hpc / r.dyn);
                snprintf(hd_s, sizeof hd_s, r.hpc_diff >= 0 ? "%.1e" : "-", r.hpc_diff);
                snprintf(fi_s, sizeof fi_s, r.peer > 0 ? "%.1f" : "null", r.peer);
                snprintf(xfi_s, sizeof xfi_s, r.peer > 0 ? "%.2f" : "-", r.peer / r.dyn);
                fprintf(tab,
                        "%-20s %5s %2d %8.1f %8.1f %8.1f %8.1f %8.1f %5.2f %5.2f %6.2f %8s %6s "
                        "%7s %6s %6s %8.1e %8.1f %6.2f %8.1f %8.1f %8.1f %6.1f/%6.1f/%6.1f/%6.1f\n",
                        r.name.c_str(), heads_s, r.q_len, r.dyn, r.stat, r.dyn_flushed, r.plan,
                        r.step, r.hbm_fraction, r.hbm_read_fraction, r.stat / r.dyn, hpc_s, xh_s,
                        hd_s, fi_s, xfi_s, r.max_diff, r.wg, r.wg > 0 ? r.wg / r.dyn : -1.0,
                        r.cta, r.m16, r.one, r.sweep_us[0],
                        r.sweep_us[1], r.sweep_us[2], r.sweep_us[3]);
                if (g_wg_n > 1 && r.wg > 0) {
                    fprintf(tab, "%-20s warpgroup forms", "");
                    for (int k = 0; k < g_wg_n; k++)
                        fprintf(tab, " %d: %.1f (x%.2f)", g_wg_list[k], r.wgs[k],
                                r.wgs[k] / r.dyn);
                    fprintf(tab, " us; max |O - dyn| %.1e\n", r.wg_diff);
                }
                if (g_sweep == SWEEP_COMBINE)
                    fprintf(tab, "%-20s static with the same combine shapes: %6.1f/%6.1f/%6.1f/%6.1f\n",
                            "", r.sweep_static_us[0], r.sweep_static_us[1], r.sweep_static_us[2],
                            r.sweep_static_us[3]);
                fflush(tab);
                rows.push_back(r);
            }
    if (json) {
        const int *sv = sweep_values();
        printf("[\n");
        for (size_t i = 0; i < rows.size(); i++) {
            const Row &r = rows[i];
            char fi[32], hp[32], st[160] = "";
            if (r.peer > 0)
                snprintf(fi, sizeof fi, "%.2f", r.peer);
            else
                snprintf(fi, sizeof fi, "null");
            if (r.hpc > 0)
                snprintf(hp, sizeof hp, "%.2f", r.hpc);
            else
                snprintf(hp, sizeof hp, "null");
            if (g_sweep == SWEEP_COMBINE)
                snprintf(st, sizeof st,
                         ", \"static_combine_us\": {\"%d\": %.2f, \"%d\": %.2f, \"%d\": %.2f, "
                         "\"%d\": %.2f}",
                         sv[0], r.sweep_static_us[0], sv[1], r.sweep_static_us[1], sv[2],
                         r.sweep_static_us[2], sv[3], r.sweep_static_us[3]);
            printf("  {\"case\": \"%s\", \"hq\": %d, \"hkv\": %d, \"q_len\": %d, \"kv_bytes\": %.0f, "
                   "\"dynamic_us\": %.2f, \"static_us\": %.2f, \"hpcops_us\": %s, "
                   "\"hpcops_rel_l2\": %.3g, \"flashinfer_us\": %s, "
                   "\"dynamic_flushed_us\": %.2f, \"static_flushed_us\": %.2f, \"plan_us\": %.2f, "
                   "\"step_us\": %.2f, \"hbm_fraction\": %.3f, \"hbm_read_fraction\": %.3f, "
                   "\"copy_rate_gbs\": %.1f, \"read_rate_gbs\": %.1f, "
                   "\"dyn_vs_static_max_abs_diff\": %.3g, \"dynamic_cta_kernel_us\": %.2f, "
                   "\"dynamic_m16_us\": %.2f, \"dynamic_one_warp_us\": %.2f, \"warpgroup_us\": %.2f, "
                   "\"warpgroup_forms_us\": [%.2f, %.2f, %.2f, %.2f, %.2f], "
                   "\"warpgroup_max_abs_diff\": %.3g, "
                   "\"%s\": {\"%d\": %.2f, \"%d\": %.2f, \"%d\": %.2f, \"%d\": %.2f}%s}%s\n",
                   r.name.c_str(), r.hq, r.hkv, r.q_len, r.kv_bytes, r.dyn, r.stat, hp,
                   r.hpc_diff, fi, r.dyn_flushed, r.stat_flushed, r.plan, r.step, r.hbm_fraction,
                   r.hbm_read_fraction, rate / 1e9, rrate / 1e9, r.max_diff, r.cta, r.m16, r.one,
                   r.wg, r.wgs[0], r.wgs[1], r.wgs[2], r.wgs[3], r.wgs[4], r.wg_diff,
                   kSweepKey[g_sweep], sv[0],
                   r.sweep_us[0], sv[1], r.sweep_us[1], sv[2], r.sweep_us[2], sv[3],
                   r.sweep_us[3], st, i + 1 < rows.size() ? "," : "");
        }
        printf("]\n");
    }
    CK(cudaFree(g_flush));
    CK(cudaStreamDestroy(s));
    return 0;
}

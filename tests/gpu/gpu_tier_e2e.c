/* gpu_tier_e2e.c - the GPU tier end to end, against a real tierkvd with an L1 pool in HBM.
 *
 *   usage: gpu_tier_e2e /path/to/tierkvd
 *
 *   engine A (child): kvc_alloc_tier(L1), kvc_store with the CUDA prologue into the IPC-mapped
 *     L1 blocks for every layer, kvc_commit (the daemon copies them down to L2 and L3);
 *   engine B (child): looks up a prompt sharing a 6-block prefix with A's, prefetches it to L1
 *     and waits, runs its own suffix's prologue into a private device pool, kvc_attend (plan +
 *     dynamic decode) over the lease's L1 blocks, the decode over its suffix, kvc_merge, and
 *     compares with a single-process GPU computation of the whole prompt; the L1 pages are
 *     compared bit for bit with the CPU prologue's pages; then the blocks are evicted from L1
 *     (promoted back from L2) and from L1 + L2 (promoted back from L3), and read back from the
 *     IPC mapping with cudaMemcpy: bit-exact each time;
 *   engine C (child) attends over a leased prefix in a loop and is SIGKILLed mid-step: the
 *     daemon stays up, the lease count drops to 0 and an A-like engine is still served.
 *   Then, where the test runs as root (it switches uid for the engines; elsewhere this part
 *   prints SKIP and the rest still counts), tenant isolation in L1 on a second daemon with
 *   tenants a (uid 61021) and b (uid 61022), each map_pool and quota_l1_blocks = 8 (an L1
 *   region of its own: one CUDA allocation, exported on its own):
 *   engine TA (uid a) writes 8 L1 blocks of a marked pattern and commits them;
 *   engine TB (uid b) gets an L1 mapping exactly its own region's size, which is not A's
 *     bytes: no byte run of A's pattern anywhere in it; A's offsets and offsets past its
 *     region are refused by kvc_offset_block_id (-1) or name B's own slots; B's lookup of
 *     A's prompt hits nothing; then B commits 24 L1 blocks (3x its quota) into its region;
 *   engine TA2 (uid a) finds all 8 of its blocks still in L1 (B's load evicted only B's own)
 *     and reads them back bit-exact through its own mapping.
 *
 * No CUDA or gRPC call is made in the parent (neither survives fork): it starts the daemon,
 * forks the engines and reads their exit codes. Prints PASS/FAIL lines; exits 0 (all passed),
 * 1 (a failure), 77 (skipped: no GPU, or the daemon has no L1 tier). alarm() bounds the run.
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <stdbool.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "engine_model.h"
#include "kvclient.h"

#define PREFIX_BLOCKS 6
#define A_TOKENS (8 * EM_PAGE)
#define B_TOKENS (PREFIX_BLOCKS * EM_PAGE + 21)
#define EXIT_SKIP 77
#define DEADLINE_S 240

static char g_dir[64], g_sock[128], g_attach[128], g_log[128];
static const char *g_config; /* --config for the daemon (the tenant phase), or NULL */
static pid_t g_daemon;
static volatile pid_t g_child; /* the engine running now, for the deadline handler */

/* ---- checks (in the engine children) ------------------------------------------------------ */

#define FAILX(...)                                                                            \
    do {                                                                                      \
        fprintf(stderr, "FAIL [pid %d] %s:%d: ", (int)getpid(), __FILE__, __LINE__);          \
        fprintf(stderr, __VA_ARGS__);                                                         \
        fprintf(stderr, "\n");                                                                \
        exit(1);                                                                              \
    } while (0)
#define REQUIRE(cond, ...)                                                                    \
    do {                                                                                      \
        if (!(cond))                                                                          \
            FAILX(__VA_ARGS__);                                                               \
    } while (0)
#define CUDA_CHECK(call)                                                                      \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess)                                                                \
            FAILX("%s: %s", #call, cudaGetErrorString(e_));                                   \
    } while (0)
#define KVC_CHECK(call)                                                                       \
    do {                                                                                      \
        int r_ = (call);                                                                      \
        if (r_ != KVC_OK)                                                                     \
            FAILX("%s: %s", #call, kvc_last_error());                                         \
    } while (0)
#define TKVK_CHECK(call)                                                                      \
    do {                                                                                      \
        int r_ = (call);                                                                      \
        if (r_ != TKVK_OK)                                                                    \
            FAILX("%s: %s (%s)", #call, tkvk_strerror(r_), tkvk_last_error());                \
    } while (0)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_ms(int ms)
{
    struct timespec d = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&d, &d) != 0 && errno == EINTR)
        ;
}

static void prompt_a(uint32_t *t)
{
    for (int i = 0; i < A_TOKENS; i++)
        t[i] = 1000u + (uint32_t)i * 7u;
}

static void prompt_b(uint32_t *t)
{
    /* the first PREFIX_BLOCKS blocks are A's (B's buffer is shorter than A's prompt) */
    uint32_t a[A_TOKENS];
    prompt_a(a);
    memcpy(t, a, sizeof(uint32_t) * PREFIX_BLOCKS * EM_PAGE);
    for (int i = PREFIX_BLOCKS * EM_PAGE; i < B_TOKENS; i++)
        t[i] = 50000u + (uint32_t)i * 3u;
}

static kvc_client *connect_engine(void)
{
    kvc_opts *o = kvc_opts_new();
    kvc_opts_set_socket(o, g_sock);
    kvc_opts_set_attach_socket(o, g_attach);
    kvc_opts_set_geometry(o, EM_LAYERS, EM_KV_HEADS, EM_HEAD_DIM, EM_PAGE, "fp8_e4m3",
                          "per_tensor", EM_MODEL);
    kvc_opts_set_timeout_ms(o, 20000);
    kvc_client *c = NULL;
    int rc = kvc_connect(o, &c);
    kvc_opts_free(o);
    REQUIRE(rc == KVC_OK, "connect: %s", kvc_last_error());
    return c;
}

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    CUDA_CHECK(cudaMemset(p, 0, bytes));
    return p;
}

static void *dev_copy(const void *src, size_t bytes)
{
    void *p = dev_alloc(bytes);
    CUDA_CHECK(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice));
    return p;
}

/* The device copies of the inputs every engine needs. */
typedef struct dev_inputs {
    float *cos_t, *sin_t;
    int32_t *pos;         /* 0 .. EM_MAX_POS-1 */
} dev_inputs;

static void inputs_init(dev_inputs *d)
{
    float *cs = malloc(sizeof(float) * EM_MAX_POS * EM_HEAD_DIM);
    int32_t *pos = malloc(sizeof(int32_t) * EM_MAX_POS);
    REQUIRE(cs && pos, "out of memory");
    em_rope(cs, cs + EM_MAX_POS * EM_HEAD_DIM / 2);
    for (int i = 0; i < EM_MAX_POS; i++)
        pos[i] = i;
    d->cos_t = dev_copy(cs, sizeof(float) * EM_MAX_POS * EM_HEAD_DIM / 2);
    d->sin_t = dev_copy(cs + EM_MAX_POS * EM_HEAD_DIM / 2, sizeof(float) * EM_MAX_POS * EM_HEAD_DIM / 2);
    d->pos = dev_copy(pos, sizeof(int32_t) * EM_MAX_POS);
    free(cs);
    free(pos);
}

static void inputs_free(dev_inputs *d)
{
    cudaFree(d->cos_t);
    cudaFree(d->sin_t);
    cudaFree(d->pos);
}

/* Prefills tokens[0..n) (full blocks) into L1 with kvc_store on stream, then commits. */
static void prefill_l1(kvc_client *c, const dev_inputs *in, cudaStream_t st,
                       const uint32_t *tokens, int n)
{
    int nb = n / EM_PAGE;
    uint64_t alloc_id = 0, offsets[64];
    KVC_CHECK(kvc_alloc_tier(c, KVC_TIER_L1, (uint32_t)nb, &alloc_id, offsets));
    int64_t slots[A_TOKENS];
    REQUIRE(n <= A_TOKENS, "prompt too long");
    for (int b = 0; b < nb; b++) {
        int64_t id = kvc_offset_block_id(c, KVC_TIER_L1, offsets[b]);
        REQUIRE(id >= 0, "L1 alloc offset %llu is not a slot", (unsigned long long)offsets[b]);
        for (int i = 0; i < EM_PAGE; i++)
            slots[b * EM_PAGE + i] = id * EM_PAGE + i;
    }
    uint16_t *qkv = malloc(sizeof(uint16_t) * (size_t)n * EM_ROW);
    REQUIRE(qkv, "out of memory");
    int64_t *d_slots = dev_copy(slots, sizeof(int64_t) * (size_t)n);
    uint16_t *d_qkv = dev_alloc(sizeof(uint16_t) * (size_t)n * EM_ROW);
    uint16_t *d_q = dev_alloc(sizeof(uint16_t) * (size_t)n * EM_Q_HEADS * EM_HEAD_DIM);
    for (int layer = 0; layer < EM_LAYERS; layer++) {
        em_qkv(tokens, n, layer, qkv);
        CUDA_CHECK(cudaMemcpyAsync(d_qkv, qkv, sizeof(uint16_t) * (size_t)n * EM_ROW,
                                   cudaMemcpyHostToDevice, st));
        kvc_store_params p;
        em_store(&p, d_qkv, n, in->pos, in->cos_t, in->sin_t, layer, d_slots, d_q);
        KVC_CHECK(kvc_store(c, KVC_TIER_L1, &p, st));
        CUDA_CHECK(cudaStreamSynchronize(st)); /* qkv is reused for the next layer */
    }
    kvc_put_result res;
    KVC_CHECK(kvc_commit(c, alloc_id, tokens, (size_t)n, 0, (uint32_t)nb, &res));
    REQUIRE(res.num_stored + res.num_duplicate == (uint32_t)nb, "commit stored %u + %u of %d",
            res.num_stored, res.num_duplicate, nb);
    cudaFree(d_slots);
    cudaFree(d_qkv);
    cudaFree(d_q);
    free(qkv);
}

/* ---- the engines ---------------------------------------------------------------------------- */

static void engine_gpu_probe(void)
{
    exit(tkvk_cuda_available() ? 0 : EXIT_SKIP);
}

static void engine_a(void)
{
    kvc_client *c = connect_engine();
    if (!kvc_has_l1(c)) {
        kvc_stats s;
        KVC_CHECK(kvc_stats_get(c, &s));
        if (s.tiers[KVC_TIER_L1].capacity_blocks == 0) {
            printf("SKIP: the daemon reports no L1 tier\n");
            kvc_close(c);
            exit(EXIT_SKIP);
        }
        FAILX("the daemon has an L1 tier of %llu blocks but this engine cannot map it: %s",
              (unsigned long long)s.tiers[KVC_TIER_L1].capacity_blocks,
              (kvc_pool_base(c, KVC_TIER_L1), kvc_last_error()));
    }
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreate(&st));
    dev_inputs in;
    inputs_init(&in);
    uint32_t tokens[A_TOKENS];
    prompt_a(tokens);
    double t0 = now_s();
    prefill_l1(c, &in, st, tokens, A_TOKENS);
    printf("PASS engine A: %d tokens x %d layers stored into L1 with kvc_store and committed "
           "(%.1f ms)\n", A_TOKENS, EM_LAYERS, (now_s() - t0) * 1e3);
    inputs_free(&in);
    CUDA_CHECK(cudaStreamDestroy(st));
    kvc_close(c);
    exit(0);
}

/* Host reference pages of prompt A: the CPU prologue (bit-identical to the CUDA one). */
static uint8_t *reference_pages(const tkvk_layout *lay)
{
    uint32_t tokens[A_TOKENS];
    prompt_a(tokens);
    uint8_t *pool = calloc(A_TOKENS / EM_PAGE, lay->block_stride);
    uint16_t *qkv = malloc(sizeof(uint16_t) * A_TOKENS * EM_ROW);
    uint16_t *q = malloc(sizeof(uint16_t) * A_TOKENS * EM_Q_HEADS * EM_HEAD_DIM);
    float *cs = malloc(sizeof(float) * EM_MAX_POS * EM_HEAD_DIM);
    REQUIRE(pool && qkv && q && cs, "out of memory");
    em_rope(cs, cs + EM_MAX_POS * EM_HEAD_DIM / 2);
    int64_t slots[A_TOKENS];
    int32_t pos[A_TOKENS];
    for (int t = 0; t < A_TOKENS; t++) {
        slots[t] = t;
        pos[t] = t;
    }
    for (int layer = 0; layer < EM_LAYERS; layer++) {
        em_qkv(tokens, A_TOKENS, layer, qkv);
        tkvk_prologue_params p;
        em_prologue(&p, qkv, A_TOKENS, pos, cs, cs + EM_MAX_POS * EM_HEAD_DIM / 2, layer, slots, q);
        p.layout = lay;
        p.pool = pool;
        p.num_blocks = A_TOKENS / EM_PAGE;
        TKVK_CHECK(tkvk_prologue_cpu(&p));
    }
    free(qkv);
    free(q);
    free(cs);
    return pool;
}

/* Reads the lease's first n blocks from the L1 mapping and compares them with ref. Returns the
 * number of differing blocks. */
static int compare_l1(kvc_client *c, kvc_lease *l, int n, const uint8_t *ref, size_t bb)
{
    const uint8_t *base = kvc_pool_base(c, KVC_TIER_L1);
    REQUIRE(base, "no L1 base: %s", kvc_last_error());
    uint8_t *got = malloc(bb);
    REQUIRE(got, "out of memory");
    int bad = 0;
    for (int i = 0; i < n; i++) {
        int64_t id = kvc_lease_block_id(c, l, (uint32_t)i, KVC_TIER_L1);
        REQUIRE(id >= 0, "block %d is not in L1 after the wait (tier %s)", i,
                kvc_tier_name(kvc_lease_tier(l, (uint32_t)i)));
        CUDA_CHECK(cudaMemcpy(got, base + (size_t)id * bb, bb, cudaMemcpyDeviceToHost));
        if (memcmp(got, ref + (size_t)i * bb, bb) != 0)
            bad++;
    }
    free(got);
    return bad;
}

/* Lookup of prompt A, prefetch to L1 and wait; checks every block came from `from` (any
 * tier when from < 0). */
static kvc_lease *restore_a(kvc_client *c, int from, double *ms)
{
    uint32_t tokens[A_TOKENS];
    prompt_a(tokens);
    kvc_lease *l = NULL;
    KVC_CHECK(kvc_lookup(c, tokens, A_TOKENS, 0, &l));
    REQUIRE(kvc_lease_num_blocks(l) == A_TOKENS / EM_PAGE, "hit %u blocks",
            kvc_lease_num_blocks(l));
    for (uint32_t i = 0; from >= 0 && i < kvc_lease_num_blocks(l); i++)
        REQUIRE(kvc_lease_tier(l, i) == from, "block %u is in %s, expected %s", i,
                kvc_tier_name(kvc_lease_tier(l, i)), kvc_tier_name(from));
    double t0 = now_s();
    KVC_CHECK(kvc_prefetch(c, l, KVC_TIER_L1, NULL));
    KVC_CHECK(kvc_wait(c, l, KVC_TIER_L1, 20000));
    *ms = (now_s() - t0) * 1e3;
    return l;
}

static void engine_b(void)
{
    kvc_client *c = connect_engine();
    REQUIRE(kvc_has_l1(c), "no L1 mapping: %s", (kvc_pool_base(c, KVC_TIER_L1), kvc_last_error()));
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreate(&st));
    dev_inputs in;
    inputs_init(&in);
    uint32_t tokens[B_TOKENS];
    prompt_b(tokens);

    kvc_lease *l = NULL;
    KVC_CHECK(kvc_lookup(c, tokens, B_TOKENS, 0, &l));
    REQUIRE(kvc_lease_num_blocks(l) == PREFIX_BLOCKS, "hit %u blocks, expected %d",
            kvc_lease_num_blocks(l), PREFIX_BLOCKS);
    kvc_cost cost;
    KVC_CHECK(kvc_cost_check(c, l, 1000.0, KVC_TIER_L1, &cost));
    REQUIRE(cost.blocks_in_tier + cost.blocks_from_l2 + cost.blocks_from_l3 == PREFIX_BLOCKS &&
                cost.restore_ms >= 0 && cost.use_cache == (cost.restore_ms < 1000.0),
            "cost check inconsistent: %u + %u + %u blocks, restore %.3f ms, use_cache %d",
            cost.blocks_in_tier, cost.blocks_from_l2, cost.blocks_from_l3, cost.restore_ms,
            cost.use_cache);
    printf("PASS cost check: restore %.3f ms (in tier %u, from L2 %u, from L3 %u; pcie %.1f GB/s)\n",
           cost.restore_ms, cost.blocks_in_tier, cost.blocks_from_l2, cost.blocks_from_l3,
           cost.pcie_gbps);
    KVC_CHECK(kvc_prefetch(c, l, KVC_TIER_L1, NULL));
    KVC_CHECK(kvc_wait(c, l, KVC_TIER_L1, 20000));
    int32_t table[PREFIX_BLOCKS];
    for (int i = 0; i < PREFIX_BLOCKS; i++) {
        int64_t id = kvc_lease_block_id(c, l, (uint32_t)i, KVC_TIER_L1);
        REQUIRE(id >= 0, "hit block %d not in L1 after the wait", i);
        table[i] = (int32_t)id;
    }

    tkvk_layout lay;
    TKVK_CHECK(tkvk_layout_init(&lay, EM_LAYERS, EM_KV_HEADS, EM_HEAD_DIM, EM_PAGE,
                                TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR));
    const size_t bb = lay.block_stride;
    REQUIRE(bb == kvc_block_bytes(c), "layout block %zu vs daemon %zu", bb, kvc_block_bytes(c));
    kvc_layout l1lay = {.struct_size = sizeof(l1lay)};
    KVC_CHECK(kvc_pool_layout(c, KVC_TIER_L1, &l1lay));
    REQUIRE(l1lay.block_stride == bb && l1lay.layer_stride == lay.layer_stride &&
            l1lay.v_offset == lay.v_offset, "L1 layout differs from the kernels' (stride %zu)",
            l1lay.block_stride);
    const int pre = PREFIX_BLOCKS * EM_PAGE, suf = B_TOKENS - pre;
    const int full_blocks = (B_TOKENS + EM_PAGE - 1) / EM_PAGE, suf_blocks = (suf + EM_PAGE - 1) / EM_PAGE;
    const size_t qrow = (size_t)EM_Q_HEADS * EM_HEAD_DIM;

    int64_t slots[B_TOKENS];
    int32_t table_full[8], table_suf[2] = {0, 1};
    for (int t = 0; t < B_TOKENS; t++)
        slots[t] = t;
    for (int b = 0; b < full_blocks; b++)
        table_full[b] = b;
    int32_t lens[3] = {B_TOKENS, pre, suf};
    uint8_t *d_full_pool = dev_alloc((size_t)full_blocks * bb);
    uint8_t *d_suf_pool = dev_alloc((size_t)suf_blocks * bb);
    int64_t *d_slots = dev_copy(slots, sizeof(slots));
    int32_t *d_lens = dev_copy(lens, sizeof(lens));
    int32_t *d_table = dev_copy(table, sizeof(table));
    int32_t *d_table_full = dev_copy(table_full, sizeof(table_full));
    int32_t *d_table_suf = dev_copy(table_suf, sizeof(table_suf));
    uint16_t *d_qkv = dev_alloc(sizeof(uint16_t) * B_TOKENS * EM_ROW);
    uint16_t *d_q_full = dev_alloc(sizeof(uint16_t) * B_TOKENS * qrow);
    uint16_t *d_q_suf = dev_alloc(sizeof(uint16_t) * (size_t)suf * qrow);
    /* outputs: ref, a (prefix), b (suffix), merged */
    uint16_t *d_o = dev_alloc(sizeof(uint16_t) * 4 * qrow);
    float *d_lse = dev_alloc(sizeof(float) * 4 * EM_Q_HEADS);
    uint16_t *qkv = malloc(sizeof(uint16_t) * B_TOKENS * EM_ROW);
    REQUIRE(qkv, "out of memory");

    /* the reference and the suffix run the kernels directly; the cached prefix goes through
     * libkvclient's own plan */
    tkvk_decode_plan *plan_ref = NULL, *plan_suf = NULL;
    kvc_plan *plan_pre = NULL;
    const int rows = (EM_Q_HEADS / EM_KV_HEADS) * 1;
    TKVK_CHECK(tkvk_decode_plan_create(&plan_ref, 1, EM_KV_HEADS, rows, EM_HEAD_DIM));
    KVC_CHECK(kvc_plan_create(c, 1, EM_Q_HEADS, 1, &plan_pre));
    TKVK_CHECK(tkvk_decode_plan_create(&plan_suf, 1, EM_KV_HEADS, rows, EM_HEAD_DIM));

    double worst_o = 0, worst_lse = 0;
    double t_attend = 0;
    for (int layer = 0; layer < EM_LAYERS; layer++) {
        em_qkv(tokens, B_TOKENS, layer, qkv);
        CUDA_CHECK(cudaMemcpyAsync(d_qkv, qkv, sizeof(uint16_t) * B_TOKENS * EM_ROW,
                                   cudaMemcpyHostToDevice, st));
        tkvk_prologue_params p;
        em_prologue(&p, d_qkv, B_TOKENS, in.pos, in.cos_t, in.sin_t, layer, d_slots, d_q_full);
        p.layout = &lay;
        p.pool = d_full_pool;
        p.num_blocks = full_blocks;
        TKVK_CHECK(tkvk_prologue_cuda(&p, st));
        em_prologue(&p, d_qkv + (size_t)pre * EM_ROW, suf, in.pos + pre, in.cos_t, in.sin_t,
                    layer, d_slots, d_q_suf);
        p.layout = &lay;
        p.pool = d_suf_pool;
        p.num_blocks = suf_blocks;
        TKVK_CHECK(tkvk_prologue_cuda(&p, st));
        const uint16_t *d_q = d_q_suf + (size_t)(suf - 1) * qrow;

        tkvk_decode_args a;
        em_decode(&a, &lay, layer, d_q_full + (size_t)(B_TOKENS - 1) * qrow, d_lens,
                  d_table_full, full_blocks, d_o, d_lse);
        a.pool = d_full_pool;
        a.num_blocks = full_blocks;
        TKVK_CHECK(tkvk_decode_plan_cuda(plan_ref, d_lens, 1, st));
        TKVK_CHECK(tkvk_decode_attend_cuda(plan_ref, &a, st));

        double t0 = now_s();
        kvc_attend_args ka;
        em_attend(&ka, layer, d_q, d_lens + 1, d_table, PREFIX_BLOCKS, d_o + qrow,
                  d_lse + EM_Q_HEADS);
        KVC_CHECK(kvc_attend(c, KVC_TIER_L1, &ka, plan_pre, st));
        em_decode(&a, &lay, layer, d_q, d_lens + 2, d_table_suf, suf_blocks, d_o + 2 * qrow,
                  d_lse + 2 * EM_Q_HEADS);
        a.pool = d_suf_pool;
        a.num_blocks = suf_blocks;
        TKVK_CHECK(tkvk_decode_plan_cuda(plan_suf, d_lens + 2, 1, st));
        TKVK_CHECK(tkvk_decode_attend_cuda(plan_suf, &a, st));
        KVC_CHECK(kvc_merge(c, KVC_TIER_L1, d_o + qrow, d_lse + EM_Q_HEADS, d_o + 2 * qrow,
                            d_lse + 2 * EM_Q_HEADS, EM_Q_HEADS, EM_HEAD_DIM, d_o + 3 * qrow,
                            d_lse + 3 * EM_Q_HEADS, st));
        CUDA_CHECK(cudaStreamSynchronize(st));
        t_attend += now_s() - t0;

        uint16_t o[4 * EM_Q_HEADS * EM_HEAD_DIM];
        float lse[4 * EM_Q_HEADS];
        uint16_t q_last[2][EM_Q_HEADS * EM_HEAD_DIM];
        CUDA_CHECK(cudaMemcpy(o, d_o, sizeof(o), cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(lse, d_lse, sizeof(lse), cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(q_last[0], d_q, sizeof(q_last[0]), cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(q_last[1], d_q_full + (size_t)(B_TOKENS - 1) * qrow,
                              sizeof(q_last[1]), cudaMemcpyDeviceToHost));
        REQUIRE(memcmp(q_last[0], q_last[1], sizeof(q_last[0])) == 0,
                "layer %d: the last token's query differs between suffix and full", layer);
        double eo = em_max_err(o + 3 * qrow, o, qrow);
        if (!(eo <= worst_o))
            worst_o = eo;
        for (int h = 0; h < EM_Q_HEADS; h++) {
            double d = fabs((double)lse[3 * EM_Q_HEADS + h] - lse[h]);
            if (!(d <= worst_lse))
                worst_lse = isnan(d) ? INFINITY : d;
        }
    }
    if (worst_o <= EM_O_TOL && worst_lse <= EM_LSE_TOL)
        printf("PASS engine B: cached prefix %d + own suffix %d tokens, %d layers, merged vs "
               "full: max O error %.3g (tol %.3g), max LSE error %.3g (tol %.3g); attend+merge "
               "%.3f ms/layer\n", pre, suf, EM_LAYERS, worst_o, EM_O_TOL, worst_lse, EM_LSE_TOL,
               t_attend * 1e3 / EM_LAYERS);
    else
        FAILX("merged output off the full computation: max O error %.3g (tol %.3g), max LSE "
              "error %.3g (tol %.3g)", worst_o, EM_O_TOL, worst_lse, EM_LSE_TOL);

    /* pages: L1 as engine A wrote them == the CPU prologue's, then after tier round trips */
    uint8_t *ref = reference_pages(&lay);
    int bad = compare_l1(c, l, PREFIX_BLOCKS, ref, bb);
    REQUIRE(bad == 0, "%d of %d L1 blocks differ from the CPU prologue's pages", bad,
            PREFIX_BLOCKS);
    printf("PASS L1 pages written by kvc_store (CUDA) == CPU prologue pages, %d blocks\n",
           PREFIX_BLOCKS);
    KVC_CHECK(kvc_release(c, l));
    l = NULL;

    uint32_t ta[A_TOKENS];
    prompt_a(ta);
    const int na = A_TOKENS / EM_PAGE;
    uint32_t ev = 0, pinned = 0;
    double ms = 0;
    KVC_CHECK(kvc_flush(c)); /* every block reached L3 before L2 is emptied below */
    KVC_CHECK(kvc_evict(c, KVC_TIER_L1, ta, A_TOKENS, &ev, &pinned));
    REQUIRE(pinned == 0, "%u blocks pinned at the L1 eviction", pinned);
    l = restore_a(c, KVC_TIER_L2, &ms);
    bad = compare_l1(c, l, na, ref, bb);
    REQUIRE(bad == 0, "L2 -> L1: %d of %d blocks differ", bad, na);
    printf("PASS evict L1 (%u blocks) -> promote L2 -> L1: %d blocks bit-exact (%.2f ms)\n", ev,
           na, ms);
    KVC_CHECK(kvc_release(c, l));
    uint32_t ev2 = 0;
    KVC_CHECK(kvc_evict(c, KVC_TIER_L1, ta, A_TOKENS, &ev, &pinned));
    KVC_CHECK(kvc_evict(c, KVC_TIER_L2, ta, A_TOKENS, &ev2, &pinned));
    REQUIRE(pinned == 0, "%u blocks pinned at the L2 eviction", pinned);
    l = restore_a(c, KVC_TIER_L3, &ms);
    bad = compare_l1(c, l, na, ref, bb);
    REQUIRE(bad == 0, "L3 -> L1: %d of %d blocks differ", bad, na);
    printf("PASS evict L1 (%u) + L2 (%u) -> promote L3 -> L1: %d blocks bit-exact (%.2f ms)\n",
           ev, ev2, na, ms);
    KVC_CHECK(kvc_release(c, l));

    free(ref);
    free(qkv);
    tkvk_decode_plan_destroy(plan_ref);
    kvc_plan_destroy(plan_pre);
    tkvk_decode_plan_destroy(plan_suf);
    void *bufs[] = {d_full_pool, d_suf_pool, d_slots, d_lens, d_table, d_table_full,
                    d_table_suf, d_qkv, d_q_full, d_q_suf, d_o, d_lse};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        CUDA_CHECK(cudaFree(bufs[i]));
    inputs_free(&in);
    CUDA_CHECK(cudaStreamDestroy(st));
    kvc_close(c);
    exit(0);
}

/* Engine C: leases A's prefix in L1 and attends over it in a loop until killed; writes one
 * byte to fd after the first step. */
static int g_fd = -1;

static void engine_c(void)
{
    kvc_client *c = connect_engine();
    double ms;
    kvc_lease *l = restore_a(c, -1, &ms); /* held until the SIGKILL */
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreate(&st));
    const int nb = A_TOKENS / EM_PAGE;
    int32_t table[A_TOKENS / EM_PAGE], len = A_TOKENS;
    for (int i = 0; i < nb; i++) {
        int64_t id = kvc_lease_block_id(c, l, (uint32_t)i, KVC_TIER_L1);
        REQUIRE(id >= 0, "engine C: block %d not in L1 after the wait", i);
        table[i] = (int32_t)id;
    }
    int32_t *d_table = dev_copy(table, sizeof(table)), *d_len = dev_copy(&len, sizeof(len));
    uint16_t *d_q = dev_alloc(sizeof(uint16_t) * EM_Q_HEADS * EM_HEAD_DIM);
    uint16_t *d_o = dev_alloc(sizeof(uint16_t) * EM_Q_HEADS * EM_HEAD_DIM);
    float *d_lse = dev_alloc(sizeof(float) * EM_Q_HEADS);
    kvc_plan *plan = NULL;
    KVC_CHECK(kvc_plan_create(c, 1, EM_Q_HEADS, 1, &plan));
    for (long step = 0;; step++) {
        for (int layer = 0; layer < EM_LAYERS; layer++) {
            kvc_attend_args a;
            em_attend(&a, layer, d_q, d_len, d_table, nb, d_o, d_lse);
            KVC_CHECK(kvc_attend(c, KVC_TIER_L1, &a, plan, st));
        }
        if (step == 0) {
            CUDA_CHECK(cudaStreamSynchronize(st));
            char one = '1';
            REQUIRE(write(g_fd, &one, 1) == 1, "pipe");
        }
        if (step % 64 == 63)
            CUDA_CHECK(cudaStreamSynchronize(st)); /* bound the queue; killed mid-step anyway */
    }
}

static void checker_lease_held(void)
{
    kvc_client *c = connect_engine();
    kvc_stats s;
    KVC_CHECK(kvc_stats_get(c, &s));
    REQUIRE(s.leases_active >= 1, "engine C's lease is not counted (%llu)",
            (unsigned long long)s.leases_active);
    kvc_close(c);
    exit(0);
}

static void checker_after_kill(void)
{
    kvc_client *c = connect_engine();
    kvc_stats s;
    double deadline = now_s() + 5.0;
    do {
        KVC_CHECK(kvc_stats_get(c, &s));
        if (s.leases_active == 0)
            break;
        sleep_ms(20);
    } while (now_s() < deadline);
    REQUIRE(s.leases_active == 0, "%llu leases active 5 s after the SIGKILL",
            (unsigned long long)s.leases_active);
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreate(&st));
    dev_inputs in;
    inputs_init(&in);
    uint32_t tokens[A_TOKENS];
    for (int i = 0; i < A_TOKENS; i++)
        tokens[i] = 90000u + (uint32_t)i;
    prefill_l1(c, &in, st, tokens, A_TOKENS);
    kvc_lease *l = NULL;
    KVC_CHECK(kvc_lookup(c, tokens, A_TOKENS, 0, &l));
    REQUIRE(kvc_lease_num_blocks(l) == A_TOKENS / EM_PAGE, "new prompt hit %u blocks",
            kvc_lease_num_blocks(l));
    KVC_CHECK(kvc_release(c, l));
    printf("PASS after SIGKILL of engine C mid-step: leases back to 0, an A-like engine "
           "prefilled and hit %d blocks\n", A_TOKENS / EM_PAGE);
    inputs_free(&in);
    CUDA_CHECK(cudaStreamDestroy(st));
    kvc_close(c);
    exit(0);
}

/* ---- tenant isolation in L1 (the second daemon, run as root) ------------------------------ */

static int start_daemon(const char *bin);
static int stop_daemon(void);

#define UID_TA 61021
#define UID_TB 61022
#define T_QUOTA 8
static const char kTagA[] = "tenant-a-L1-block"; /* A's pattern: the tag, then the block no. */
static int g_tpipe[2] = {-1, -1};   /* TA -> parent: its L1 offsets */
static uint64_t g_ta_off[T_QUOTA];  /* what TA reported (inherited by the later children) */

static void fill_a(uint8_t *p, size_t bb, int b)
{
    for (size_t i = 0; i < bb; i += 32) {
        size_t n = bb - i < 32 ? bb - i : 32;
        char unit[32] = {0};
        snprintf(unit, sizeof(unit), "%s%02d", kTagA, b);
        memcpy(p + i, unit, n);
    }
}

static void tenant_prompt(uint32_t *t, uint32_t seed, int n)
{
    for (int i = 0; i < n; i++)
        t[i] = seed * 7919u + (uint32_t)i * 13u + 5u;
}

/* Commits nb L1 blocks of prompt `seed`; the bytes of block b are fill(b). Returns the offsets. */
static void tenant_commit_l1(kvc_client *c, uint32_t seed, int nb, bool pattern_a, uint64_t *offs)
{
    size_t bb = kvc_block_bytes(c);
    uint8_t *base = kvc_pool_base(c, KVC_TIER_L1);
    REQUIRE(base, "no L1 base: %s", kvc_last_error());
    uint64_t alloc_id = 0;
    KVC_CHECK(kvc_alloc_tier(c, KVC_TIER_L1, (uint32_t)nb, &alloc_id, offs));
    uint8_t *host = malloc(bb);
    REQUIRE(host, "out of memory");
    for (int b = 0; b < nb; b++) {
        int64_t id = kvc_offset_block_id(c, KVC_TIER_L1, offs[b]);
        REQUIRE(id >= 0, "L1 alloc offset %llu is not a slot of this tenant's mapping",
                (unsigned long long)offs[b]);
        if (pattern_a)
            fill_a(host, bb, b);
        else
            memset(host, 0xB0 + (b & 15), bb);
        CUDA_CHECK(cudaMemcpy(base + (size_t)id * bb, host, bb, cudaMemcpyHostToDevice));
    }
    uint32_t tokens[T_QUOTA * EM_PAGE];
    REQUIRE(nb <= T_QUOTA, "too many blocks");
    tenant_prompt(tokens, seed, nb * EM_PAGE);
    kvc_put_result res;
    KVC_CHECK(kvc_commit(c, alloc_id, tokens, (size_t)nb * EM_PAGE, 0, (uint32_t)nb, &res));
    REQUIRE(res.num_stored == (uint32_t)nb, "commit stored %u of %d", res.num_stored, nb);
    free(host);
}

/* The size the daemon gives a tenant's L1 region: its quota in blocks, in 2 MiB units. */
static int64_t region_blocks(size_t bb)
{
    uint64_t bytes = ((uint64_t)T_QUOTA * bb + (2u << 20) - 1) / (2u << 20) * (2u << 20);
    return (int64_t)(bytes / bb);
}

static void engine_ta(void)
{
    kvc_client *c = connect_engine();
    REQUIRE(kvc_has_l1(c), "tenant a (map_pool) got no L1 mapping: %s", kvc_last_error());
    size_t bb = kvc_block_bytes(c);
    REQUIRE(kvc_pool_num_blocks(c, KVC_TIER_L1) == region_blocks(bb),
            "tenant a's L1 mapping holds %lld blocks, its region %lld",
            (long long)kvc_pool_num_blocks(c, KVC_TIER_L1), (long long)region_blocks(bb));
    uint64_t offs[T_QUOTA];
    tenant_commit_l1(c, 1, T_QUOTA, true, offs);
    REQUIRE(write(g_tpipe[1], offs, sizeof(offs)) == (ssize_t)sizeof(offs), "pipe: %s",
            strerror(errno));
    printf("PASS tenant a: %d L1 blocks written through its own region's mapping (%lld blocks) "
           "and committed\n", T_QUOTA, (long long)region_blocks(bb));
    kvc_close(c);
    exit(0);
}

/* Bytes of the whole L1 mapping that contain A's tag: 0 for a mapping that is not A's. */
static size_t count_tag_a(kvc_client *c)
{
    size_t bb = kvc_block_bytes(c);
    size_t bytes = (size_t)kvc_pool_num_blocks(c, KVC_TIER_L1) * bb;
    uint8_t *all = malloc(bytes);
    REQUIRE(all, "out of memory");
    CUDA_CHECK(cudaMemcpy(all, kvc_pool_base(c, KVC_TIER_L1), bytes, cudaMemcpyDeviceToHost));
    size_t hits = 0;
    for (size_t i = 0; i + sizeof(kTagA) - 1 <= bytes; i++)
        if (all[i] == (uint8_t)kTagA[0] && memcmp(all + i, kTagA, sizeof(kTagA) - 1) == 0)
            hits++;
    free(all);
    return hits;
}

static void engine_tb(void)
{
    kvc_client *c = connect_engine();
    REQUIRE(kvc_has_l1(c), "tenant b (map_pool) got no L1 mapping: %s", kvc_last_error());
    size_t bb = kvc_block_bytes(c);
    int64_t nb = kvc_pool_num_blocks(c, KVC_TIER_L1);
    REQUIRE(nb == region_blocks(bb), "tenant b's L1 mapping holds %lld blocks, its region %lld",
            (long long)nb, (long long)region_blocks(bb));
    size_t found = count_tag_a(c);
    REQUIRE(found == 0, "tenant b's L1 mapping holds %zu runs of tenant a's bytes", found);
    /* forged offsets: past its region (where a single shared pool would have A's blocks) and
     * A's own offsets, which name at most B's own slots */
    REQUIRE(kvc_offset_block_id(c, KVC_TIER_L1, (uint64_t)nb * bb) == -1,
            "an offset past b's region was accepted");
    REQUIRE(kvc_offset_block_id(c, KVC_TIER_L1, 64ull << 20) == -1,
            "an offset past b's region (the whole pool's size) was accepted");
    for (int i = 0; i < T_QUOTA; i++) {
        int64_t id = kvc_offset_block_id(c, KVC_TIER_L1, g_ta_off[i] + (uint64_t)nb * bb);
        REQUIRE(id == -1, "a's offset %llu shifted past b's region was accepted",
                (unsigned long long)g_ta_off[i]);
    }
    uint32_t tokens[T_QUOTA * EM_PAGE];
    tenant_prompt(tokens, 1, T_QUOTA * EM_PAGE); /* a's prompt */
    kvc_lease *l = NULL;
    int rc = kvc_lookup(c, tokens, T_QUOTA * EM_PAGE, 0, &l);
    REQUIRE(rc == KVC_OK || rc == KVC_ENOTFOUND, "b's lookup: %s", kvc_last_error());
    REQUIRE(!l || kvc_lease_num_blocks(l) == 0, "b hit %u of a's blocks",
            kvc_lease_num_blocks(l));
    if (l)
        kvc_release(c, l);
    /* b's load: three times its quota, all into its own region */
    for (uint32_t round = 0; round < 3; round++) {
        uint64_t offs[T_QUOTA];
        tenant_commit_l1(c, 100 + round, T_QUOTA, false, offs);
    }
    found = count_tag_a(c);
    REQUIRE(found == 0, "after its load, b's L1 mapping holds %zu runs of a's bytes", found);
    printf("PASS tenant b: its L1 mapping is its own region (%lld blocks), holds none of a's "
           "bytes, refuses offsets past it; its lookup of a's prompt misses; it committed %d "
           "L1 blocks into it\n", (long long)nb, 3 * T_QUOTA);
    kvc_close(c);
    exit(0);
}

static void engine_ta2(void)
{
    kvc_client *c = connect_engine();
    size_t bb = kvc_block_bytes(c);
    uint32_t tokens[T_QUOTA * EM_PAGE];
    tenant_prompt(tokens, 1, T_QUOTA * EM_PAGE);
    kvc_lease *l = NULL;
    KVC_CHECK(kvc_lookup(c, tokens, T_QUOTA * EM_PAGE, 0, &l));
    REQUIRE(kvc_lease_num_blocks(l) == T_QUOTA, "a hit %u of its %d blocks",
            kvc_lease_num_blocks(l), T_QUOTA);
    uint8_t *want = malloc(bb), *got = malloc(bb);
    REQUIRE(want && got, "out of memory");
    for (uint32_t i = 0; i < T_QUOTA; i++) {
        REQUIRE(kvc_lease_tier(l, i) == KVC_TIER_L1, "a's block %u left L1 (now %s) under b's "
                "load", i, kvc_tier_name(kvc_lease_tier(l, i)));
        int64_t id = kvc_lease_block_id(c, l, i, KVC_TIER_L1);
        REQUIRE(id >= 0, "a's block %u: no L1 id", i);
        CUDA_CHECK(cudaMemcpy(got, (uint8_t *)kvc_pool_base(c, KVC_TIER_L1) + (size_t)id * bb,
                              bb, cudaMemcpyDeviceToHost));
        fill_a(want, bb, (int)i);
        REQUIRE(memcmp(got, want, bb) == 0, "a's block %u differs", i);
    }
    kvc_release(c, l);
    free(want);
    free(got);
    printf("PASS tenant a: all %d of its L1 blocks survived b's load, bit-exact\n", T_QUOTA);
    kvc_close(c);
    exit(0);
}

#define SAME_USER ((uid_t)-1)

/* Runs fn in a child, as uid/gid `uid` unless SAME_USER; returns its exit status. */
static int run_child_as(uid_t uid, void (*fn)(void))
{
    fflush(NULL);
    pid_t p = fork();
    if (p < 0)
        return -1;
    if (p == 0) {
        alarm(DEADLINE_S); /* a child has its own alarm: the parent's is not inherited */
        if (uid != SAME_USER &&
            (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0)) {
            fprintf(stderr, "FAIL cannot become uid %u: %s\n", (unsigned)uid, strerror(errno));
            _exit(1);
        }
        fn();
        _exit(1);
    }
    g_child = p;
    int st = 0;
    while (waitpid(p, &st, 0) < 0 && errno == EINTR)
        ;
    g_child = 0;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The tenant phase: returns the number of failures (0 when skipped). */
static int tenant_phase(const char *bin)
{
    if (geteuid() != 0) {
        printf("SKIP tenant L1 isolation: switching uid needs root\n");
        return 0;
    }
    char conf[] = "/tmp/tkv-gpu-e2e-conf-XXXXXX";
    int fd = mkstemp(conf);
    if (fd < 0) {
        perror("mkstemp");
        return 1;
    }
    char text[512];
    int n = snprintf(text, sizeof(text),
                     "tenant.a.uid = %d\ntenant.a.map_pool = on\ntenant.a.quota_l1_blocks = %d\n"
                     "tenant.b.uid = %d\ntenant.b.map_pool = on\ntenant.b.quota_l1_blocks = %d\n"
                     "tenant.ops.uid = 0\ntenant.ops.admin = on\n",
                     UID_TA, T_QUOTA, UID_TB, T_QUOTA);
    bool wrote = write(fd, text, (size_t)n) == n;
    close(fd);
    if (!wrote || chmod(conf, 0644) != 0) {
        perror("config");
        unlink(conf);
        return 1;
    }
    g_config = conf;
    int failed = 0;
    if (start_daemon(bin) != 0) {
        stop_daemon();
        unlink(conf);
        return 1;
    }
    if (pipe(g_tpipe) != 0) {
        perror("pipe");
        failed++;
    } else {
        failed += run_child_as(UID_TA, engine_ta) != 0;
        close(g_tpipe[1]);
        if (!failed && read(g_tpipe[0], g_ta_off, sizeof(g_ta_off)) != (ssize_t)sizeof(g_ta_off)) {
            printf("FAIL tenant a reported no offsets\n");
            failed++;
        }
        close(g_tpipe[0]);
    }
    if (!failed)
        failed += run_child_as(UID_TB, engine_tb) != 0;
    if (!failed)
        failed += run_child_as(UID_TA, engine_ta2) != 0;
    if (stop_daemon() != 0) {
        printf("FAIL the tenant daemon did not stop cleanly\n");
        failed++;
    }
    g_config = NULL;
    unlink(conf);
    return failed;
}

/* ---- the parent: daemon, children --------------------------------------------------------- */

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

static void show_log(void)
{
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "tail -30 %s >&2", g_log);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot show %s\n", g_log);
}

static int run_child(void (*fn)(void))
{
    return run_child_as(SAME_USER, fn);
}

static void probe_daemon(void)
{
    kvc_opts *o = kvc_opts_new();
    kvc_opts_set_socket(o, g_sock);
    kvc_client *c = NULL;
    int rc = kvc_connect(o, &c);
    kvc_close(c);
    kvc_opts_free(o);
    exit(rc == KVC_OK ? 0 : 1);
}

static int start_daemon(const char *bin)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/tkv-gpu-e2e-XXXXXX");
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        return -1;
    }
    char data[96], run[96];
    snprintf(data, sizeof(data), "%s/data", g_dir);
    snprintf(run, sizeof(run), "%s/run", g_dir);
    snprintf(g_sock, sizeof(g_sock), "%s/tierkv.sock", run);
    snprintf(g_attach, sizeof(g_attach), "%s/attach.sock", run);
    snprintf(g_log, sizeof(g_log), "%s/tierkvd.log", g_dir);
    char layers[16], heads[16], dim[16], page[16];
    snprintf(layers, sizeof(layers), "%d", EM_LAYERS);
    snprintf(heads, sizeof(heads), "%d", EM_KV_HEADS);
    snprintf(dim, sizeof(dim), "%d", EM_HEAD_DIM);
    snprintf(page, sizeof(page), "%d", EM_PAGE);
    const char *argv[] = {bin, "--foreground", "--data-dir", data, "--run-dir", run,
                          "--grpc-socket", g_sock, "--attach-socket", g_attach, "--http-port",
                          "0", "--num-layers", layers, "--num-kv-heads", heads, "--head-dim",
                          dim, "--block-tokens", page, "--model-id", EM_MODEL, "--l2-blocks",
                          "4096", "--l1-bytes", "64M", "--gpu-device", "0", "--log-level",
                          "warn", g_config ? "--config" : NULL, g_config, NULL};
    fflush(NULL);
    g_daemon = fork();
    if (g_daemon < 0) {
        perror("fork");
        return -1;
    }
    if (g_daemon == 0) {
        int fd = open(g_log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd >= 0) {
            dup2(fd, STDOUT_FILENO);
            dup2(fd, STDERR_FILENO);
        }
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    double deadline = now_s() + 60.0;
    while (now_s() < deadline) {
        int st;
        if (waitpid(g_daemon, &st, WNOHANG) == g_daemon) {
            fprintf(stderr, "FAIL tierkvd exited early (status 0x%x); its log:\n", st);
            show_log();
            g_daemon = 0;
            return -1;
        }
        if (access(g_sock, F_OK) == 0 && access(g_attach, F_OK) == 0 && run_child(probe_daemon) == 0) {
            /* the tenant phase's engines run as other users: they must reach the sockets */
            if (g_config && (chmod(g_dir, 0755) != 0 || chmod(run, 0755) != 0 ||
                             chmod(g_sock, 0777) != 0 || chmod(g_attach, 0777) != 0)) {
                perror("chmod");
                return -1;
            }
            return 0;
        }
        sleep_ms(100);
    }
    fprintf(stderr, "FAIL tierkvd did not serve within 60 s; its log:\n");
    show_log();
    return -1;
}

/* SIGTERM (then SIGKILL after 30 s); returns 0 on a clean exit. */
static int stop_daemon(void)
{
    int rc = -1;
    if (g_daemon > 0) {
        kill(g_daemon, SIGTERM);
        double deadline = now_s() + 30.0;
        int st = 0;
        pid_t w = 0;
        while ((w = waitpid(g_daemon, &st, WNOHANG)) == 0 && now_s() < deadline)
            sleep_ms(20);
        if (w == g_daemon) {
            rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        } else {
            kill(g_daemon, SIGKILL);
            waitpid(g_daemon, NULL, 0);
        }
        if (rc != 0) {
            fprintf(stderr, "tierkvd stopped with status %d; its log:\n", rc);
            show_log();
        }
        g_daemon = 0;
    }
    if (g_dir[0])
        nftw(g_dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    return rc;
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "FAIL gpu_tier_e2e: deadline passed; stopping\n";
    if (write(STDERR_FILENO, msg, sizeof(msg) - 1) < 0) {
        /* nothing else to do in a signal handler */
    }
    if (g_child > 0)
        kill(g_child, SIGKILL);
    if (g_daemon > 0)
        kill(g_daemon, SIGKILL);
    _exit(1);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s /path/to/tierkvd\n", argv[0]);
        return 2;
    }
    if (access(argv[1], X_OK) != 0) {
        fprintf(stderr, "FAIL %s is not an executable: %s\n", argv[1], strerror(errno));
        return 1;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGALRM, on_alarm);
    alarm(DEADLINE_S + 30);
    /* TKV_GPU_E2E_NO_PROBE=1 goes past the probe, so the daemon's own answer (no L1 -> 77)
     * and the start/stop path can be checked on a machine without a GPU */
    const char *np = getenv("TKV_GPU_E2E_NO_PROBE");
    int rc = np && strcmp(np, "1") == 0 ? 0 : run_child(engine_gpu_probe);
    if (rc == EXIT_SKIP) {
        printf("SKIP gpu_tier_e2e: no usable GPU\n");
        return EXIT_SKIP;
    }
    if (rc != 0) {
        printf("FAIL gpu_tier_e2e: the GPU probe failed (%d)\n", rc);
        return 1;
    }
    if (start_daemon(argv[1]) != 0) {
        stop_daemon();
        return 1;
    }
    int failed = 0;
    rc = run_child(engine_a);
    if (rc == EXIT_SKIP) {
        stop_daemon();
        return EXIT_SKIP;
    }
    failed += rc != 0;
    if (!failed)
        failed += run_child(engine_b) != 0;

    if (!failed) {
        int fds[2];
        if (pipe(fds) != 0) {
            perror("pipe");
            stop_daemon();
            return 1;
        }
        fflush(NULL);
        pid_t pc = fork();
        if (pc == 0) {
            alarm(DEADLINE_S);
            close(fds[0]);
            g_fd = fds[1];
            engine_c();
            _exit(1);
        }
        g_child = pc;
        close(fds[1]);
        char one = 0;
        ssize_t got = pc > 0 ? read(fds[0], &one, 1) : -1;
        close(fds[0]);
        if (got != 1) {
            printf("FAIL engine C did not reach its first step\n");
            failed++;
        } else if (run_child(checker_lease_held) != 0) {
            failed++;
        }
        if (pc > 0) {
            kill(pc, SIGKILL);
            int st = 0;
            waitpid(pc, &st, 0);
            g_child = 0;
            if (!(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL)) {
                printf("FAIL engine C ended by itself (status 0x%x) instead of by SIGKILL\n", st);
                failed++;
            }
        }
        int dst = 0;
        if (waitpid(g_daemon, &dst, WNOHANG) != 0) {
            printf("FAIL tierkvd died after engine C was killed\n");
            show_log();
            g_daemon = 0;
            failed++;
        } else if (!failed) {
            failed += run_child(checker_after_kill) != 0;
        }
    }
    if (stop_daemon() != 0) {
        printf("FAIL tierkvd did not stop cleanly\n");
        failed++;
    }
    if (!failed)
        failed += tenant_phase(argv[1]);
    printf("%s gpu_tier_e2e\n", failed ? "FAIL" : "PASS");
    return failed ? 1 : 0;
}

/* test_engine.c - libkvclient's engine side against a real tierkvd, on the CPU pool:
 *
 *   engine A (a child process, trusted attach) prefills a prompt: kvc_alloc_tier(L2) for its
 *     full blocks, kvc_store (CPU prologue) for every layer straight into the mapped pool,
 *     kvc_commit;
 *   engine B (another child, ordinary attach) looks up a prompt sharing a long prefix with A's,
 *     prefetches it to L2 and waits, runs the prologue of its own suffix into a private pool,
 *     attends over the lease's blocks (kvc_attend) and over its suffix (tkvk_decode_cpu),
 *     merges (kvc_merge) and compares with a single-process computation of the whole prompt;
 *   engine C holds a lease and is SIGKILLed: the lease count drops and the daemon keeps
 *     serving an A-like engine.
 *
 * The test process itself never initialises gRPC (it only forks and waits), so each child
 * starts gRPC from scratch.
 */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine_model.h"
#include "harness.h"

#define PREFIX_BLOCKS 6                      /* shared by A and B */
#define A_TOKENS (8 * EM_PAGE)               /* A: 8 full blocks */
#define B_TOKENS (PREFIX_BLOCKS * EM_PAGE + 21) /* B: the prefix + a 21-token suffix */

static tkvt_daemon g_d;

/* Child-side check: prints the failure and exits 1 (Check's asserts belong to the test
 * process, not to its children). */
#define REQUIRE(cond, ...)                                                                    \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "engine child %d: %s:%d: ", (int)getpid(), __FILE__, __LINE__);   \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fprintf(stderr, "\n");                                                            \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

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

static kvc_client *connect_engine(int trusted)
{
    kvc_opts *o = kvc_opts_new();
    kvc_opts_set_socket(o, g_d.sock);
    kvc_opts_set_attach_socket(o, g_d.attach);
    kvc_opts_set_geometry(o, EM_LAYERS, EM_KV_HEADS, EM_HEAD_DIM, EM_PAGE, "fp8_e4m3",
                          "per_tensor", EM_MODEL);
    kvc_opts_set_timeout_ms(o, 20000);
    if (trusted)
        kvc_opts_set_trusted(o, 1);
    kvc_client *c = NULL;
    int rc = kvc_connect(o, &c);
    kvc_opts_free(o);
    REQUIRE(rc == KVC_OK, "connect (trusted %d): %s", trusted, kvc_last_error());
    return c;
}

/* Prefills tokens[0..n) (full blocks only) through kvc_alloc_tier + kvc_store + kvc_commit. */
static void prefill(kvc_client *c, const uint32_t *tokens, int n)
{
    int nb = n / EM_PAGE;
    uint64_t alloc_id = 0, offsets[64];
    int rc = kvc_alloc_tier(c, KVC_TIER_L2, (uint32_t)nb, &alloc_id, offsets);
    REQUIRE(rc == KVC_OK, "alloc_tier L2: %s", kvc_last_error());
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)n);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
    uint16_t *qkv = malloc(sizeof(uint16_t) * (size_t)n * EM_ROW);
    uint16_t *q = malloc(sizeof(uint16_t) * (size_t)n * EM_Q_HEADS * EM_HEAD_DIM);
    float *cs = malloc(sizeof(float) * EM_MAX_POS * EM_HEAD_DIM), *sn = cs + EM_MAX_POS * EM_HEAD_DIM / 2;
    REQUIRE(slots && pos && qkv && q && cs, "out of memory");
    em_rope(cs, sn);
    for (int b = 0; b < nb; b++) {
        int64_t id = kvc_offset_block_id(c, KVC_TIER_L2, offsets[b]);
        REQUIRE(id >= 0, "alloc offset %llu is not a slot", (unsigned long long)offsets[b]);
        for (int i = 0; i < EM_PAGE; i++)
            slots[b * EM_PAGE + i] = id * EM_PAGE + i;
    }
    for (int t = 0; t < n; t++)
        pos[t] = t;
    for (int layer = 0; layer < EM_LAYERS; layer++) {
        em_qkv(tokens, n, layer, qkv);
        kvc_store_params p;
        em_store(&p, qkv, n, pos, cs, sn, layer, slots, q);
        rc = kvc_store(c, KVC_TIER_L2, &p, NULL);
        REQUIRE(rc == KVC_OK, "kvc_store layer %d: %s", layer, kvc_last_error());
    }
    kvc_put_result res;
    rc = kvc_commit(c, alloc_id, tokens, (size_t)n, 0, (uint32_t)nb, &res);
    REQUIRE(rc == KVC_OK, "commit: %s", kvc_last_error());
    REQUIRE(res.num_stored + res.num_duplicate == (uint32_t)nb, "commit stored %u + %u of %d",
            res.num_stored, res.num_duplicate, nb);
    free(slots);
    free(pos);
    free(qkv);
    free(q);
    free(cs);
}

/* Engine A: trusted prefill of prompt A; an ordinary client may not kvc_store into L2. */
static void engine_a(void)
{
    uint32_t tokens[A_TOKENS];
    prompt_a(tokens);
    kvc_client *c = connect_engine(1);
    REQUIRE(kvc_pool_writable(c, KVC_TIER_L2) == 1, "trusted client's L2 is not writable");
    REQUIRE(kvc_has_l1(c) == 0, "an L1 pool without a GPU");
    prefill(c, tokens, A_TOKENS);

    kvc_client *ro = connect_engine(0);
    REQUIRE(kvc_pool_writable(ro, KVC_TIER_L2) == 0, "ordinary client's L2 is writable");
    kvc_store_params p;
    REQUIRE(kvc_store_params_init(&p, sizeof(p)) == KVC_OK, "%s", kvc_last_error());
    int rc = kvc_store(ro, KVC_TIER_L2, &p, NULL);
    REQUIRE(rc == KVC_EINVAL, "kvc_store on a read-only mapping gave %d (%s)", rc,
            kvc_last_error());
    REQUIRE(strstr(kvc_last_error(), "read-only") != NULL, "message: %s", kvc_last_error());
    rc = kvc_store(ro, KVC_TIER_L1, &p, NULL);
    REQUIRE(rc == KVC_EUNAVAILABLE, "kvc_store on L1 without a GPU tier gave %d", rc);
    kvc_close(ro);
    kvc_close(c);
    exit(0);
}

/* The struct_size contract (kvclient.h, "ABI") on kvc_attend_args, whose call ka already
 * produced o_ref: a caller's larger struct with zeroed extra fields gives the same result, a
 * non-zero unknown field or a struct_size below the first version's is refused, and so is an
 * enum value outside KVC_DTYPE_*. */
static void check_attend_versions(kvc_client *c, const kvc_attend_args *ka, const uint16_t *o_ref)
{
    uint16_t o[EM_Q_HEADS * EM_HEAD_DIM];
    float lse[EM_Q_HEADS];
    struct {
        kvc_attend_args a;
        uint64_t later[2]; /* fields of a later version of the header */
    } grown;
    REQUIRE(kvc_attend_args_init(&grown.a, sizeof(grown)) == KVC_OK, "%s", kvc_last_error());
    REQUIRE(grown.a.struct_size == sizeof(grown) && grown.later[0] == 0 && grown.later[1] == 0,
            "init of a larger struct: size %zu", grown.a.struct_size);
    grown.a = *ka;
    grown.a.struct_size = sizeof(grown);
    grown.a.out = o;
    grown.a.lse = lse;
    REQUIRE(kvc_attend(c, KVC_TIER_L2, &grown.a, NULL, NULL) == KVC_OK, "grown struct: %s",
            kvc_last_error());
    REQUIRE(memcmp(o, o_ref, sizeof(o)) == 0, "a larger struct changed the output");
    grown.later[1] = 1;
    REQUIRE(kvc_attend(c, KVC_TIER_L2, &grown.a, NULL, NULL) == KVC_EINVAL,
            "an unknown non-zero field was accepted");
    kvc_attend_args bad = *ka;
    bad.struct_size = sizeof(bad) - sizeof(void *);
    REQUIRE(kvc_attend(c, KVC_TIER_L2, &bad, NULL, NULL) == KVC_EINVAL, "short struct_size");
    bad = *ka;
    bad.q_dtype = 7;
    REQUIRE(kvc_attend(c, KVC_TIER_L2, &bad, NULL, NULL) == KVC_EINVAL, "q_dtype 7 accepted");
    REQUIRE(strstr(kvc_last_error(), "KVC_DTYPE") != NULL, "message: %s", kvc_last_error());
    kvc_layout lay = {.struct_size = 0};
    REQUIRE(kvc_pool_layout(c, KVC_TIER_L2, &lay) == KVC_EINVAL, "layout of struct_size 0");

    /* a plan needs a GPU; its shape is checked before that */
    kvc_plan *pl = NULL;
    REQUIRE(kvc_plan_create(c, 1, EM_Q_HEADS + 1, 1, &pl) == KVC_EINVAL && pl == NULL,
            "a plan for %d query heads over %d KV heads", EM_Q_HEADS + 1, EM_KV_HEADS);
    int rc = kvc_plan_create(c, 1, EM_Q_HEADS, 1, &pl);
    REQUIRE(rc == KVC_OK || (rc == KVC_EUNAVAILABLE && pl == NULL), "plan: %d (%s)", rc,
            kvc_last_error());
    kvc_plan_destroy(pl);
}

/* Engine B: cached prefix (lease, L2) + own suffix, merged, against the full computation. */
static void engine_b(void)
{
    uint32_t tokens[B_TOKENS];
    prompt_b(tokens);
    kvc_client *c = connect_engine(0);
    kvc_lease *l = NULL;
    int rc = kvc_lookup(c, tokens, B_TOKENS, 0, &l);
    REQUIRE(rc == KVC_OK, "lookup: %s", kvc_last_error());
    REQUIRE(kvc_lease_num_blocks(l) == PREFIX_BLOCKS, "lookup hit %u blocks, expected %d",
            kvc_lease_num_blocks(l), PREFIX_BLOCKS);
    rc = kvc_prefetch(c, l, KVC_TIER_L2, NULL);
    REQUIRE(rc == KVC_OK, "prefetch: %s", kvc_last_error());
    rc = kvc_wait(c, l, KVC_TIER_L2, 10000);
    REQUIRE(rc == KVC_OK, "wait: %s", kvc_last_error());
    int32_t table[PREFIX_BLOCKS];
    for (int i = 0; i < PREFIX_BLOCKS; i++) {
        int64_t id = kvc_lease_block_id(c, l, (uint32_t)i, KVC_TIER_L2);
        REQUIRE(id >= 0, "hit block %d is not in L2 after the wait", i);
        table[i] = (int32_t)id;
    }
    REQUIRE(kvc_lease_block_id(c, l, PREFIX_BLOCKS, KVC_TIER_L2) == -1, "id past the lease");
    REQUIRE(kvc_lease_block_id(c, l, 0, KVC_TIER_L1) == -1, "an L1 id without a GPU tier");

    tkvk_layout lay; /* private pools: the natural stride */
    REQUIRE(tkvk_layout_init(&lay, EM_LAYERS, EM_KV_HEADS, EM_HEAD_DIM, EM_PAGE,
                             TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR) == TKVK_OK, "layout");
    REQUIRE(lay.block_stride == kvc_block_bytes(c), "block bytes %zu vs layout %zu",
            kvc_block_bytes(c), lay.block_stride);
    kvc_layout l2lay = {.struct_size = sizeof(l2lay)};
    REQUIRE(kvc_pool_layout(c, KVC_TIER_L2, &l2lay) == KVC_OK, "%s", kvc_last_error());
    REQUIRE(l2lay.block_stride % 4096 == 0 && l2lay.block_stride >= lay.block_stride &&
            l2lay.layer_stride == lay.layer_stride && l2lay.token_stride == lay.token_stride &&
            l2lay.v_offset == lay.v_offset && l2lay.kscale_offset == lay.kscale_offset &&
            l2lay.elem_bytes == lay.elem_bytes, "L2 layout strides differ from the kernels'");
    REQUIRE(l2lay.num_layers == EM_LAYERS && l2lay.num_kv_heads == EM_KV_HEADS &&
            l2lay.head_dim == EM_HEAD_DIM && l2lay.page_tokens == EM_PAGE &&
            l2lay.kv_dtype == KVC_DTYPE_FP8_E4M3 && l2lay.scale_mode == KVC_SCALE_PER_TENSOR,
            "L2 layout shape");

    const int pre = PREFIX_BLOCKS * EM_PAGE, suf = B_TOKENS - pre;
    const int full_blocks = (B_TOKENS + EM_PAGE - 1) / EM_PAGE;
    const int suf_blocks = (suf + EM_PAGE - 1) / EM_PAGE;
    const size_t qrow = (size_t)EM_Q_HEADS * EM_HEAD_DIM;
    uint8_t *full_pool = calloc((size_t)full_blocks, lay.block_stride);
    uint8_t *suf_pool = calloc((size_t)suf_blocks, lay.block_stride);
    uint16_t *qkv = malloc(sizeof(uint16_t) * B_TOKENS * EM_ROW);
    uint16_t *q_full = malloc(sizeof(uint16_t) * B_TOKENS * qrow);
    uint16_t *q_suf = malloc(sizeof(uint16_t) * (size_t)suf * qrow);
    float *cs = malloc(sizeof(float) * EM_MAX_POS * EM_HEAD_DIM), *sn = cs + EM_MAX_POS * EM_HEAD_DIM / 2;
    REQUIRE(full_pool && suf_pool && qkv && q_full && q_suf && cs, "out of memory");
    em_rope(cs, sn);
    int64_t slots[B_TOKENS];
    int32_t pos[B_TOKENS], table_full[8], table_suf[2] = {0, 1};
    for (int t = 0; t < B_TOKENS; t++) {
        slots[t] = t;
        pos[t] = t;
    }
    for (int b = 0; b < full_blocks; b++)
        table_full[b] = b;

    double worst_o = 0, worst_lse = 0;
    for (int layer = 0; layer < EM_LAYERS; layer++) {
        /* the single-process reference: the whole prompt */
        em_qkv(tokens, B_TOKENS, layer, qkv);
        tkvk_prologue_params p;
        em_prologue(&p, qkv, B_TOKENS, pos, cs, sn, layer, slots, q_full);
        p.layout = &lay;
        p.pool = full_pool;
        p.num_blocks = full_blocks;
        REQUIRE(tkvk_prologue_cpu(&p) == TKVK_OK, "full prologue: %s", tkvk_last_error());
        /* B's own suffix, positions pre.., into its private pool */
        em_prologue(&p, qkv + (size_t)pre * EM_ROW, suf, pos + pre, cs, sn, layer, slots, q_suf);
        p.layout = &lay;
        p.pool = suf_pool;
        p.num_blocks = suf_blocks;
        REQUIRE(tkvk_prologue_cpu(&p) == TKVK_OK, "suffix prologue: %s", tkvk_last_error());
        const uint16_t *q = q_suf + (size_t)(suf - 1) * qrow;
        REQUIRE(memcmp(q, q_full + (size_t)(B_TOKENS - 1) * qrow, qrow * 2) == 0,
                "layer %d: the last token's query differs between suffix and full", layer);

        uint16_t o_ref[EM_Q_HEADS * EM_HEAD_DIM], o_a[EM_Q_HEADS * EM_HEAD_DIM],
            o_b[EM_Q_HEADS * EM_HEAD_DIM], o[EM_Q_HEADS * EM_HEAD_DIM];
        float lse_ref[EM_Q_HEADS], lse_a[EM_Q_HEADS], lse_b[EM_Q_HEADS], lse[EM_Q_HEADS];
        int32_t len_full = B_TOKENS, len_pre = pre, len_suf = suf;
        tkvk_decode_args a;
        em_decode(&a, &lay, layer, q, &len_full, table_full, full_blocks, o_ref, lse_ref);
        a.pool = full_pool;
        a.num_blocks = full_blocks;
        REQUIRE(tkvk_decode_cpu(&a) == TKVK_OK, "full decode: %s", tkvk_last_error());

        kvc_attend_args ka;
        em_attend(&ka, layer, q, &len_pre, table, PREFIX_BLOCKS, o_a, lse_a);
        rc = kvc_attend(c, KVC_TIER_L2, &ka, NULL, NULL);
        REQUIRE(rc == KVC_OK, "kvc_attend: %s", kvc_last_error());
        if (layer == 0)
            check_attend_versions(c, &ka, o_a);
        em_decode(&a, &lay, layer, q, &len_suf, table_suf, suf_blocks, o_b, lse_b);
        a.pool = suf_pool;
        a.num_blocks = suf_blocks;
        REQUIRE(tkvk_decode_cpu(&a) == TKVK_OK, "suffix decode: %s", tkvk_last_error());
        rc = kvc_merge(c, KVC_TIER_L2, o_a, lse_a, o_b, lse_b, EM_Q_HEADS, EM_HEAD_DIM, o, lse,
                       NULL);
        REQUIRE(rc == KVC_OK, "kvc_merge: %s", kvc_last_error());

        double eo = em_max_err(o, o_ref, EM_Q_HEADS * EM_HEAD_DIM);
        for (int h = 0; h < EM_Q_HEADS; h++) {
            double d = fabs((double)lse[h] - lse_ref[h]);
            if (!(d <= worst_lse))
                worst_lse = isnan(d) ? INFINITY : d;
        }
        if (eo > worst_o)
            worst_o = eo;
    }
    /* the pages A wrote through kvc_store are the reference's pages, bit for bit */
    for (int i = 0; i < PREFIX_BLOCKS; i++) {
        const uint8_t *blk = kvc_lease_block_ptr(c, l, (uint32_t)i);
        REQUIRE(blk != NULL, "hit block %d has no mapped pointer", i);
        REQUIRE(memcmp(blk, full_pool + (size_t)i * lay.block_stride, lay.block_stride) == 0,
                "cached block %d differs from the single-process pages", i);
    }
    fprintf(stderr, "engine B: prefix %d + suffix %d tokens, %d layers: max O error %.3g "
            "(tol %.3g), max LSE error %.3g (tol %.3g)\n", pre, suf, EM_LAYERS, worst_o, EM_O_TOL,
            worst_lse, EM_LSE_TOL);
    REQUIRE(worst_o <= EM_O_TOL && worst_lse <= EM_LSE_TOL, "merged output off the reference");
    kvc_release(c, l);
    kvc_close(c);
    free(full_pool);
    free(suf_pool);
    free(qkv);
    free(q_full);
    free(q_suf);
    free(cs);
    exit(0);
}

/* Engine C: holds a lease on A's prompt, says so on fd, and waits to be killed. */
static void engine_c(int fd)
{
    uint32_t tokens[A_TOKENS];
    prompt_a(tokens);
    kvc_client *c = connect_engine(0);
    kvc_lease *l = NULL;
    int rc = kvc_lookup(c, tokens, A_TOKENS, 60000, &l);
    REQUIRE(rc == KVC_OK && kvc_lease_num_blocks(l) == A_TOKENS / EM_PAGE, "C lookup: %s",
            kvc_last_error());
    char one = '1';
    REQUIRE(write(fd, &one, 1) == 1, "pipe");
    for (;;)
        pause();
}

static uint64_t leases_active(kvc_client *c)
{
    kvc_stats st;
    int rc = kvc_stats_get(c, &st);
    REQUIRE(rc == KVC_OK, "stats: %s", kvc_last_error());
    return st.leases_active;
}

/* After C's lease was seen: wait (<= 5 s) for the count to drop to 0, then serve an A-like
 * engine: prefill a new prompt and hit A's whole prompt. */
static void checker_after_kill(void)
{
    kvc_client *c = connect_engine(1);
    double deadline = tkvt_now() + 5.0;
    uint64_t n;
    while ((n = leases_active(c)) != 0 && tkvt_now() < deadline)
        tkvt_sleep_ms(20);
    REQUIRE(n == 0, "%llu leases still active 5 s after the SIGKILL", (unsigned long long)n);
    uint32_t tokens[A_TOKENS];
    for (int i = 0; i < A_TOKENS; i++)
        tokens[i] = 90000u + (uint32_t)i;
    prefill(c, tokens, A_TOKENS);
    prompt_a(tokens);
    kvc_lease *l = NULL;
    int rc = kvc_lookup(c, tokens, A_TOKENS, 0, &l);
    REQUIRE(rc == KVC_OK && kvc_lease_num_blocks(l) == A_TOKENS / EM_PAGE,
            "lookup after the kill: %s", kvc_last_error());
    kvc_release(c, l);
    kvc_close(c);
    exit(0);
}

static void checker_lease_held(void)
{
    kvc_client *c = connect_engine(0);
    uint64_t n = leases_active(c);
    REQUIRE(n >= 1, "C's lease is not counted (%llu active)", (unsigned long long)n);
    kvc_close(c);
    exit(0);
}

/* Runs fn in a child and returns its exit status (-1: killed). */
static int run_child(void (*fn)(void))
{
    fflush(NULL);
    pid_t p = fork();
    ck_assert_int_ge(p, 0);
    if (p == 0)
        fn();
    int st = 0;
    ck_assert_int_eq(waitpid(p, &st, 0), p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

START_TEST(test_engines_share_a_cached_prefix)
{
    ck_assert_int_eq(run_child(engine_a), 0);
    ck_assert_int_eq(run_child(engine_b), 0);

    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    fflush(NULL);
    pid_t pc = fork();
    ck_assert_int_ge(pc, 0);
    if (pc == 0) {
        close(fds[0]);
        engine_c(fds[1]);
    }
    close(fds[1]);
    char one = 0;
    ssize_t got = read(fds[0], &one, 1);
    close(fds[0]);
    if (got != 1) {
        kill(pc, SIGKILL);
        waitpid(pc, NULL, 0);
        ck_abort_msg("engine C died before taking its lease");
    }
    int held = run_child(checker_lease_held);
    kill(pc, SIGKILL);
    int st = 0;
    ck_assert_int_eq(waitpid(pc, &st, 0), pc);
    ck_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    ck_assert_int_eq(held, 0);
    ck_assert_int_eq(run_child(checker_after_kill), 0);
}
END_TEST

int main(void)
{
    /* the engine geometry replaces the harness's (later flags win) */
    static const char *const extra[] = {"--num-layers", "2", "--num-kv-heads", "2",
                                        "--model-id", EM_MODEL, NULL};
    if (tkvt_daemon_start(&g_d, extra) != 0)
        return 1;
    Suite *s = suite_create("engine");
    TCase *t = tcase_create("cpu pool");
    tcase_set_timeout(t, 60);
    tcase_add_test(t, test_engines_share_a_cached_prefix);
    suite_add_tcase(s, t);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    int stop = tkvt_daemon_stop(&g_d);
    return failed == 0 && stop == 0 ? 0 : 1;
}

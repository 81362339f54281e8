/* test_load.c - 32 concurrent clients x 10,000 mixed operations against a real tierkvd:
 * zero errors, every get bit-exact.
 *
 * 32 threads share 4 client handles (two attached, reading hits through the mapped pool;
 * two by value), so both the handle's thread safety and the daemon's concurrency are on
 * trial. Each thread works on 16 prompts of its own and 16 prompts shared by every thread
 * (concurrent puts of the same blocks: duplicates must be dropped, never corrupt).
 * Operations: lookup, batched lookup, get (checked), put, release, alloc/write/commit,
 * prefetch+wait, stats.
 *
 * --fast: 32 threads on 32 attached handles, so every critical-path call takes the fast path
 * (the attach connection); the daemon must show 32 fast-path threads, and no lease may remain
 * at the end.
 * TKVT_LOAD_OPS overrides the 10,000 operations per client (e.g. for a quick local run).
 */
#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define NUM_THREADS 32
#define MAX_HANDLES 32
#define OWN_PROMPTS 16
#define SHARED_PROMPTS 16
#define PROMPT_BLOCKS 4
#define BT TKVT_BLOCK_TOKENS

static tkvt_daemon g_d;
static kvc_client *g_clients[MAX_HANDLES];
static int g_handles = 4;
static long g_ops = 10000;
static atomic_ulong g_errors, g_gets_checked, g_mismatches, g_calls;

typedef struct worker {
    int id;
    uint64_t rng;
} worker;

static uint64_t next(worker *w)
{
    w->rng ^= w->rng << 13;
    w->rng ^= w->rng >> 7;
    w->rng ^= w->rng << 17;
    return w->rng;
}

static void error(worker *w, const char *what, int rc)
{
    if (atomic_fetch_add(&g_errors, 1) < 10)
        fprintf(stderr, "load: thread %d: %s: %d %s\n", w->id, what, rc, kvc_last_error());
}

static uint64_t pick_prompt(worker *w)
{
    uint64_t r = next(w) % (OWN_PROMPTS + SHARED_PROMPTS);
    return r < OWN_PROMPTS ? 10000 + (uint64_t)w->id * 100 + r : 90000 + (r - OWN_PROMPTS);
}

static void *run(void *arg)
{
    worker *w = arg;
    kvc_client *c = g_clients[w->id % g_handles];
    size_t bb = kvc_block_bytes(c);
    uint8_t *buf = malloc(PROMPT_BLOCKS * bb), *want = malloc(bb);
    uint32_t tokens[PROMPT_BLOCKS * BT];
    long done = 0;
    while (done < g_ops) {
        uint64_t seed = pick_prompt(w);
        tkvt_tokens(seed, tokens, PROMPT_BLOCKS * BT);
        uint32_t op = (uint32_t)(next(w) % 100);
        int rc;
        if (op < 8) {
            /* the zero-copy path: alloc -> write -> commit (duplicates dropped) */
            uint64_t id;
            rc = kvc_alloc(c, PROMPT_BLOCKS, &id, NULL);
            done++;
            if (rc != KVC_OK) {
                error(w, "alloc", rc);
                continue;
            }
            for (uint32_t i = 0; i < PROMPT_BLOCKS && rc == KVC_OK; i++) {
                tkvt_payload(seed, i, want, bb);
                rc = kvc_write(c, id, i, want, bb);
                done++;
            }
            if (rc == KVC_OK)
                rc = kvc_commit(c, id, tokens, PROMPT_BLOCKS * BT, 0, PROMPT_BLOCKS, NULL);
            else
                kvc_abort(c, id);
            done++;
            if (rc != KVC_OK)
                error(w, "write/commit", rc);
            continue;
        }
        if (op < 12) {
            /* a scheduler step: several prompts in one call, each with its own lease */
            const uint32_t *toks[3];
            size_t ns[3];
            uint32_t batch_tokens[3][PROMPT_BLOCKS * BT];
            for (int i = 0; i < 3; i++) {
                tkvt_tokens(pick_prompt(w), batch_tokens[i], PROMPT_BLOCKS * BT);
                toks[i] = batch_tokens[i];
                ns[i] = (size_t)(i + 1) * BT; /* 1, 2 and 3 blocks */
            }
            kvc_lease *ls[3];
            rc = kvc_lookup_batch(c, toks, ns, 3, 0, ls);
            done++;
            if (rc != KVC_OK) {
                error(w, "lookup_batch", rc);
                continue;
            }
            for (int i = 0; i < 3; i++) {
                if (kvc_lease_num_query_blocks(ls[i]) != (uint32_t)(i + 1) ||
                    kvc_lease_num_blocks(ls[i]) > (uint32_t)(i + 1))
                    error(w, "lookup_batch: lease does not match its prompt", 0);
                rc = kvc_release(c, ls[i]);
                done++;
                if (rc != KVC_OK)
                    error(w, "release (batch)", rc);
            }
            continue;
        }
        if (op < 14) {
            kvc_stats s;
            rc = kvc_stats_get(c, &s);
            done++;
            if (rc != KVC_OK)
                error(w, "stats", rc);
            continue;
        }
        /* the engine path: lookup -> (prefetch+wait) -> get (checked) -> put the rest */
        kvc_lease *l;
        rc = kvc_lookup(c, tokens, PROMPT_BLOCKS * BT, 0, &l);
        done++;
        if (rc != KVC_OK) {
            error(w, "lookup", rc);
            continue;
        }
        uint32_t hit = kvc_lease_num_blocks(l);
        if (hit > 0 && op < 20) {
            rc = kvc_wait(c, l, KVC_TIER_L2, 20000);
            done++;
            if (rc != KVC_OK)
                error(w, "prefetch", rc);
        }
        if (hit > 0) {
            rc = kvc_get(c, l, 0, hit, buf, PROMPT_BLOCKS * bb);
            done++;
            if (rc != KVC_OK) {
                error(w, "get", rc);
            } else {
                for (uint32_t i = 0; i < hit; i++) {
                    tkvt_payload(seed, i, want, bb);
                    if (memcmp(want, buf + (size_t)i * bb, bb) != 0)
                        atomic_fetch_add(&g_mismatches, 1);
                    atomic_fetch_add(&g_gets_checked, 1);
                }
            }
        }
        rc = kvc_release(c, l);
        done++;
        if (rc != KVC_OK)
            error(w, "release", rc);
        if (hit < PROMPT_BLOCKS) {
            for (uint32_t i = hit; i < PROMPT_BLOCKS; i++)
                tkvt_payload(seed, i, buf + (size_t)(i - hit) * bb, bb);
            rc = kvc_put(c, tokens, PROMPT_BLOCKS * BT, hit, buf, PROMPT_BLOCKS - hit, NULL);
            done++;
            if (rc != KVC_OK)
                error(w, "put", rc);
        }
    }
    atomic_fetch_add(&g_calls, (unsigned long)done);
    free(buf);
    free(want);
    return NULL;
}

/* Threads of the daemon named tkvd-fast: one per fast-path connection. */
static int count_fast_threads(pid_t pid)
{
    char path[320], comm[32];
    snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        snprintf(path, sizeof(path), "/proc/%d/task/%s/comm", (int)pid, de->d_name);
        FILE *f = fopen(path, "r");
        if (f && fgets(comm, sizeof(comm), f) && strncmp(comm, "tkvd-fast", 9) == 0)
            n++;
        if (f)
            fclose(f);
    }
    closedir(d);
    return n;
}

int main(int argc, char **argv)
{
    const char *e = getenv("TKVT_LOAD_OPS");
    if (e && atol(e) > 0)
        g_ops = atol(e);
    int fast = argc > 1 && strcmp(argv[1], "--fast") == 0;
    if (fast)
        g_handles = MAX_HANDLES;
    if (tkvt_daemon_start(&g_d, NULL) != 0)
        return 1;
    int rc = 1;
    int n_conn = 0;
    for (; n_conn < g_handles; n_conn++) {
        int r = tkvt_connect(&g_d, fast || n_conn % 2 == 0, &g_clients[n_conn]);
        if (r != KVC_OK) {
            fprintf(stderr, "load: connect: %s\n", kvc_last_error());
            goto out;
        }
    }
    if (fast) {
        int n = -1;
        for (double until = tkvt_now() + 5; tkvt_now() < until; tkvt_sleep_ms(20))
            if ((n = count_fast_threads(g_d.pid)) == g_handles)
                break;
        if (n != g_handles) {
            fprintf(stderr, "load: the daemon serves %d fast-path connections, expected %d\n", n,
                    g_handles);
            goto out;
        }
    }
    pthread_t th[NUM_THREADS];
    worker w[NUM_THREADS];
    double t0 = tkvt_now();
    for (int i = 0; i < NUM_THREADS; i++) {
        w[i].id = i;
        w[i].rng = tkvt_mix((uint64_t)i + 1) | 1;
        pthread_create(&th[i], NULL, run, &w[i]);
    }
    for (int i = 0; i < NUM_THREADS; i++)
        pthread_join(th[i], NULL);
    double dt = tkvt_now() - t0;
    unsigned long calls = atomic_load(&g_calls), errs = atomic_load(&g_errors);
    unsigned long checked = atomic_load(&g_gets_checked), bad = atomic_load(&g_mismatches);
    kvc_stats end;
    int leases = kvc_stats_get(g_clients[0], &end) == KVC_OK ? (int)end.leases_active : -1;
    printf("load: %d threads on %d handles%s, %lu calls in %.1f s (%.0f calls/s): %lu errors, "
           "%lu blocks read back, %lu not bit-exact, %d leases left\n",
           NUM_THREADS, g_handles, fast ? " (fast path)" : "", calls, dt, calls / dt, errs,
           checked, bad, leases);
    rc = (errs == 0 && bad == 0 && checked > 0 && leases == 0 &&
          calls >= (unsigned long)g_ops * NUM_THREADS)
             ? 0
             : 1;
out:
    for (int i = 0; i < n_conn; i++)
        kvc_close(g_clients[i]);
    int st = tkvt_daemon_stop(&g_d);
    if (st != 0) {
        fprintf(stderr, "load: tierkvd did not exit cleanly (status %d)\n", st);
        rc = 1;
    }
    return rc;
}

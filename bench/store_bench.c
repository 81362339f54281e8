/* store_bench - the tier manager (storage/store.c) end to end, in-process. A benchmark, never
 * a test.
 *
 *   store_bench [--dir DIR] [--blocks N] [--block-kib N] [--chains N] [--index-blocks N]
 *               [--workers N] [--json]
 *
 * In one run, with a memcpy and a checksum pass measured as the ceilings of the copy paths:
 *   - put into L2 (copy + checksum + publish), GB/s, as a ratio to memcpy;
 *   - write-through to L3 (flush after the puts), GB/s;
 *   - prefetch L3 -> L2 of all blocks as --chains concurrent leases, GB/s;
 *   - get from L2 by value, GB/s;
 *   - longest-prefix lookup of a 256-block chain with --index-blocks other blocks indexed
 *     (median, p99) and lookups/s from 2 threads (lookup + release each).
 * Prints a table; --json prints one object.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tkv_base.h"
#include "tkv_csum.h"
#include "tkv_keys.h"
#include "tkv_store.h"

typedef struct cfg {
    const char *dir;
    size_t blocks, block_bytes, chains, index_blocks;
    unsigned workers;
    int json;
} cfg;

static void die(const char *what, int rc)
{
    fprintf(stderr, "store_bench: %s: %s\n", what, tkv_strerror(rc));
    exit(1);
}

static double secs(uint64_t t0) { return (double)(tkv_now_ns() - t0) / 1e9; }

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* FP8-looking bytes: random with a skewed exponent, so zstd sees realistic entropy. */
static void fill(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = (uint8_t)((x & 0x87) | ((x >> 8) & 0x30));
    }
}

/* Chain c's keys (blocks [0, n)) under one root; tokens are (c, position). */
static void chain(const tkv_key *root, size_t c, size_t n, uint32_t *tokens, tkv_key *keys)
{
    for (size_t i = 0; i < n * 64; i++)
        tokens[i] = (uint32_t)(c * 1000003u + i);
    tkv_key_chain(root, tokens, n * 64, 64, keys, n);
}

typedef struct pf_arg {
    tkv_store *s;
    const tkv_key *keys;
    size_t n;
} pf_arg;

static void *prefetch_main(void *p)
{
    pf_arg *a = p;
    uint64_t lease, ticket;
    size_t hit;
    int rc, status;
    if ((rc = tkv_store_lookup(a->s, a->keys, a->n, 1, 60000, &lease, &hit, NULL)) != TKV_OK)
        die("lookup", rc);
    if (hit != a->n)
        die("lookup (blocks missing)", TKV_ENOTFOUND);
    if ((rc = tkv_store_prefetch(a->s, lease, TKV_TIER_L2, NULL, NULL, &ticket)) != TKV_OK)
        die("prefetch", rc);
    if ((rc = tkv_store_wait(a->s, ticket, -1, &status)) != TKV_OK || status != TKV_OK)
        die("prefetch wait", rc ? rc : status);
    tkv_store_lease_release(a->s, lease);
    return NULL;
}

typedef struct lk_arg {
    tkv_store *s;
    const tkv_key *keys;
    uint64_t done;
} lk_arg;

static void *lookup_main(void *p)
{
    lk_arg *a = p;
    uint64_t end = tkv_now_ns() + 1000000000ull;
    while (tkv_now_ns() < end) {
        for (int i = 0; i < 64; i++) {
            uint64_t lease;
            size_t hit;
            tkv_store_lookup(a->s, a->keys, 256, 2, 0, &lease, &hit, NULL);
            tkv_store_lease_release(a->s, lease);
        }
        a->done += 64;
    }
    return NULL;
}

int main(int argc, char **argv)
{
    cfg c = {.dir = "/tmp", .blocks = 256, .block_bytes = 1u << 20, .chains = 8,
             .index_blocks = 100000, .workers = 4};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json")) {
            c.json = 1;
        } else if (v && !strcmp(a, "--dir")) {
            c.dir = v, i++;
        } else if (v && !strcmp(a, "--blocks")) {
            c.blocks = strtoul(v, NULL, 10), i++;
        } else if (v && !strcmp(a, "--block-kib")) {
            c.block_bytes = strtoul(v, NULL, 10) * 1024, i++;
        } else if (v && !strcmp(a, "--chains")) {
            c.chains = strtoul(v, NULL, 10), i++;
        } else if (v && !strcmp(a, "--workers")) {
            c.workers = (unsigned)strtoul(v, NULL, 10), i++;
        } else if (v && !strcmp(a, "--index-blocks")) {
            c.index_blocks = strtoul(v, NULL, 10), i++;
        } else {
            fprintf(stderr, "usage: store_bench [--dir DIR] [--blocks N] [--block-kib N] "
                            "[--chains N] [--index-blocks N] [--workers N] [--json]\n");
            return 2;
        }
    }
    if (c.blocks == 0 || c.block_bytes == 0 || c.chains == 0 || c.chains > c.blocks) {
        fprintf(stderr, "store_bench: need blocks >= chains >= 1 and a block size\n");
        return 2;
    }
    tkv_log_level = TKV_LOG_WARN;
    char l3dir[4096];
    snprintf(l3dir, sizeof(l3dir), "%s/store_bench-XXXXXX", c.dir);
    if (!mkdtemp(l3dir)) {
        perror("mkdtemp");
        return 1;
    }

    uint8_t fp[TKV_KEY_BYTES] = {0x42};
    tkv_key root;
    tkv_key_root(fp, "bench", 5, &root);
    size_t per = c.blocks / c.chains, n = per * c.chains, bb = c.block_bytes;
    uint8_t *data = tkv_xmalloc(n * bb);
    for (size_t i = 0; i < n; i++)
        fill(data + i * bb, bb, i);
    tkv_key *keys = tkv_xmalloc(n * sizeof(tkv_key));
    uint32_t *tokens = tkv_xmalloc(n * 64 * sizeof(uint32_t));
    for (size_t ch = 0; ch < c.chains; ch++)
        chain(&root, ch, per, tokens + ch * per * 64, keys + ch * per);

    /* ceilings: memcpy and the checksum over the same bytes */
    uint8_t *dst = tkv_xmalloc(n * bb);
    memcpy(dst, data, n * bb); /* fault the pages in */
    uint64_t t0 = tkv_now_ns();
    memcpy(dst, data, n * bb);
    double memcpy_gbps = (double)(n * bb) / secs(t0) / 1e9;
    t0 = tkv_now_ns();
    uint64_t sink = 0;
    for (size_t i = 0; i < n; i++)
        sink ^= tkv_csum64(data + i * bb, bb);
    double csum_gbps = (double)(n * bb) / secs(t0) / 1e9;

    tkv_store_opts *o = tkv_store_opts_new();
    tkv_store_opts_set_block(o, bb, 64);
    tkv_store_opts_set_fingerprint(o, fp);
    tkv_store_opts_set_l2_blocks(o, n + 16);
    tkv_store_opts_set_l3(o, l3dir, 0);
    tkv_store *s;
    int rc = tkv_store_opts_set_workers(o, c.workers);
    if (rc != TKV_OK)
        die("--workers", rc);
    rc = tkv_store_open(o, &s);
    if (rc != TKV_OK)
        die("open", rc);

    /* put: all chains, into L2; write-through queues behind */
    const void **payloads = tkv_xmalloc(per * sizeof(void *));
    t0 = tkv_now_ns();
    for (size_t ch = 0; ch < c.chains; ch++) {
        for (size_t i = 0; i < per; i++)
            payloads[i] = data + (ch * per + i) * bb;
        size_t stored;
        if ((rc = tkv_store_put(s, NULL, keys + ch * per, tokens + ch * per * 64, payloads, per,
                                &stored)) != TKV_OK)
            die("put", rc);
    }
    double put_s = secs(t0);
    if ((rc = tkv_store_flush(s)) != TKV_OK)
        die("flush", rc);
    double wt_s = secs(t0);

    /* get from L2 */
    t0 = tkv_now_ns();
    for (size_t ch = 0; ch < c.chains; ch++) {
        uint64_t lease;
        size_t hit;
        tkv_store_lookup(s, keys + ch * per, per, 1, 0, &lease, &hit, NULL);
        for (size_t i = 0; i < hit; i++)
            if ((rc = tkv_store_get(s, lease, (uint32_t)i, dst + (ch * per + i) * bb, bb)) != TKV_OK)
                die("get", rc);
        tkv_store_lease_release(s, lease);
    }
    double get_s = secs(t0);
    if (memcmp(dst, data, n * bb) != 0)
        die("get returned other bytes", TKV_ECHECKSUM);

    /* prefetch: evict L2 (already durable: no I/O), then promote all chains at once */
    size_t ev, pin;
    tkv_store_evict(s, TKV_TIER_L2, NULL, 0, &ev, &pin);
    if (ev != n)
        die("evict", TKV_ESTATE);
    pthread_t *th = tkv_xmalloc(c.chains * sizeof(pthread_t));
    pf_arg *pa = tkv_xmalloc(c.chains * sizeof(pf_arg));
    t0 = tkv_now_ns();
    for (size_t ch = 0; ch < c.chains; ch++) {
        pa[ch] = (pf_arg){s, keys + ch * per, per};
        pthread_create(&th[ch], NULL, prefetch_main, &pa[ch]);
    }
    for (size_t ch = 0; ch < c.chains; ch++)
        pthread_join(th[ch], NULL);
    double pf_s = secs(t0);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    if (st.blocks_tier[TKV_TIER_L2] != n)
        die("prefetch left blocks behind", TKV_ESTATE);
    tkv_store_close(s);
    tkv_store_opts_free(o);

    /* lookup: a 256-block chain among index_blocks other blocks, L3 off, tiny blocks */
    o = tkv_store_opts_new();
    tkv_store_opts_set_block(o, 64, 64);
    tkv_store_opts_set_fingerprint(o, fp);
    tkv_store_opts_set_l2_blocks(o, c.index_blocks + 512);
    if ((rc = tkv_store_open(o, &s)) != TKV_OK)
        die("open", rc);
    tkv_store_opts_free(o);
    static uint8_t small[64];
    tkv_key lk[256];
    uint32_t ltok[256 * 64];
    const void *lp[256];
    for (int i = 0; i < 256; i++)
        lp[i] = small;
    for (size_t b = 0; b < c.index_blocks; b += 256) {
        size_t m = c.index_blocks - b < 256 ? c.index_blocks - b : 256;
        chain(&root, 1000000 + b, m, ltok, lk);
        tkv_store_put(s, NULL, lk, ltok, lp, m, NULL);
    }
    chain(&root, 7, 256, ltok, lk);
    size_t stored;
    tkv_store_put(s, NULL, lk, ltok, lp, 256, &stored);
    enum { kRuns = 20000 };
    uint64_t *lat = tkv_xmalloc(kRuns * sizeof(uint64_t));
    for (int r = 0; r < kRuns; r++) {
        uint64_t lease;
        size_t hit;
        uint64_t a = tkv_now_ns();
        tkv_store_lookup(s, lk, 256, 2, 0, &lease, &hit, NULL);
        lat[r] = tkv_now_ns() - a;
        if (hit != 256)
            die("lookup missed", TKV_ENOTFOUND);
        tkv_store_lease_release(s, lease);
    }
    qsort(lat, kRuns, sizeof(uint64_t), cmp_u64);
    double p50 = (double)lat[kRuns / 2] / 1e3, p99 = (double)lat[kRuns * 99 / 100] / 1e3;
    lk_arg la[2] = {{s, lk, 0}, {s, lk, 0}};
    pthread_t lt[2];
    for (int t = 0; t < 2; t++)
        pthread_create(&lt[t], NULL, lookup_main, &la[t]);
    for (int t = 0; t < 2; t++)
        pthread_join(lt[t], NULL);
    double lps = (double)(la[0].done + la[1].done);
    tkv_store_close(s);

    double gb = (double)(n * bb) / 1e9;
    double put_gbps = gb / put_s, wt_gbps = gb / wt_s, get_gbps = gb / get_s, pf_gbps = gb / pf_s;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    if (c.json) {
        printf("{\"blocks\":%zu,\"block_bytes\":%zu,\"chains\":%zu,\"cpus\":%ld,\"workers\":%u,"
               "\"memcpy_gbps\":%.3f,\"csum_gbps\":%.3f,\"put_l2_gbps\":%.3f,"
               "\"put_ratio_memcpy\":%.3f,\"write_through_gbps\":%.3f,\"get_l2_gbps\":%.3f,"
               "\"prefetch_l3_gbps\":%.3f,\"index_blocks\":%zu,\"lookup256_p50_us\":%.3f,"
               "\"lookup256_p99_us\":%.3f,\"lookups_per_s_2threads\":%.0f,\"sink\":%llu}\n",
               n, bb, c.chains, ncpu, c.workers, memcpy_gbps, csum_gbps, put_gbps, put_gbps / memcpy_gbps,
               wt_gbps, get_gbps, pf_gbps, c.index_blocks, p50, p99, lps,
               (unsigned long long)(sink & 1));
    } else {
        printf("store_bench: %zu blocks of %zu KiB in %zu chains, L3 in %s, %ld CPUs, "
               "%u workers\n", n, bb / 1024, c.chains, c.dir, ncpu, c.workers);
        printf("%-36s %10.2f\n", "memcpy GB/s (ceiling)", memcpy_gbps);
        printf("%-36s %10.2f\n", "checksum GB/s", csum_gbps);
        printf("%-36s %10.2f  (%.2fx memcpy)\n", "put into L2 GB/s", put_gbps, put_gbps / memcpy_gbps);
        printf("%-36s %10.2f\n", "put + write-through to L3 GB/s", wt_gbps);
        printf("%-36s %10.2f  (%.2fx memcpy)\n", "get from L2 GB/s", get_gbps, get_gbps / memcpy_gbps);
        printf("%-36s %10.2f\n", "prefetch L3 -> L2 GB/s", pf_gbps);
        printf("%-36s %10.2f\n", "lookup 256 blocks p50 us", p50);
        printf("%-36s %10.2f\n", "lookup 256 blocks p99 us", p99);
        printf("%-36s %10.0f\n", "lookups/s, 2 threads", lps);
    }

    char cmd[4200];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", l3dir);
    if (system(cmd) != 0)
        fprintf(stderr, "store_bench: could not remove %s\n", l3dir);
    free(lat);
    free(th);
    free(pa);
    free(payloads);
    free(data);
    free(dst);
    free(keys);
    free(tokens);
    return 0;
}

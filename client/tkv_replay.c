/* tkv_replay.c - `tierkv-replay`: replays the Mooncake conversation trace through
 * libkvclient the way an inference engine would, checking every byte it reads back.
 *
 * Per request: lookup(prompt tokens) -> prefetch the hit blocks to L2 and wait -> get them
 * (compared bit-exact with what was put) -> put the missing blocks -> release the lease.
 *
 * Trace model. Each trace hash id names one 512-token trace block; ids are prefix hashes
 * (equal ids imply equal prefixes), so a request's prompt is the concatenation of its ids'
 * blocks. Tokens are a pure function of (hash id, position in the block), and a cache block's
 * payload a pure function of (hash id, sub-block index), so equal ids give equal tokens and
 * equal bytes, and chains are real. One trace block = 512 / block_tokens cache blocks; a trace
 * block counts as hit when all its cache blocks hit within the leading run. The whole prompt
 * is used (the trace's input_length only trims the last block's tail; ignoring it keeps every
 * trace block whole, which is what the trace's own hit-rate figures count).
 *
 * The infinite-cache hit rate of the replayed part is computed from the trace alone (a set of
 * seen ids) and printed beside the measured one; with a cache large enough to hold what is
 * replayed the two are equal, and --expect-exact turns a difference into exit status 2.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvclient.h"

#define TRACE_BLOCK_TOKENS 512

/* =========================================================================================
 * deterministic synthetic data
 * ========================================================================================= */

static inline uint64_t splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Token j (0..511) of trace block `id`: below 2^31, like real vocabularies' ids are small. */
static inline uint32_t trace_token(uint64_t id, uint32_t j)
{
    return (uint32_t)(splitmix64((id << 9) | j) & 0x7fffffffu);
}

/* Payload of cache block `sub` of trace block `id`: a xorshift stream seeded per block. */
static void fill_block(uint8_t *dst, size_t n, uint64_t id, uint32_t sub)
{
    uint64_t s = splitmix64((id << 8) ^ sub ^ 0x7469657221ull) | 1;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        memcpy(dst + i, &s, 8);
    }
    for (; i < n; i++)
        dst[i] = (uint8_t)(s >> (8 * (i & 7)));
}

/* =========================================================================================
 * trace
 * ========================================================================================= */

typedef struct request {
    uint32_t num_ids;
    uint64_t *ids;
} request;

typedef struct trace {
    size_t num, cap;
    request *req;
    uint64_t max_id;
} trace;

static int trace_read(FILE *f, const char *path, size_t limit, trace *t);

/* Parses `"hash_ids": [a, b, ...]` of each line; other fields are not needed. */
static int trace_load(const char *path, size_t limit, trace *t)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "tierkv-replay: cannot open trace %s: %s\n", path, strerror(errno));
        return -1;
    }
    int rc = trace_read(f, path, limit, t);
    fclose(f);
    return rc;
}

/* trace_load's parser, on an open stream (left open; the fuzzer hands it memory). */
static int trace_read(FILE *f, const char *path, size_t limit, trace *t)
{
    char *line = NULL;
    size_t cap = 0, lineno = 0;
    ssize_t len;
    int rc = 0;
    memset(t, 0, sizeof(*t));
    while ((limit == 0 || t->num < limit) && (len = getline(&line, &cap, f)) > 0) {
        lineno++;
        char *p = strstr(line, "\"hash_ids\"");
        if (!p || !(p = strchr(p, '['))) {
            if (strspn(line, " \t\r\n") == (size_t)len)
                continue; /* blank line */
            fprintf(stderr, "tierkv-replay: %s:%zu: no hash_ids array\n", path, lineno);
            rc = -1;
            break;
        }
        p++;
        request r = {0, NULL};
        size_t rcap = 0;
        for (;;) {
            while (*p == ' ' || *p == ',')
                p++;
            if (*p == ']')
                break;
            char *end;
            errno = 0;
            unsigned long long v = strtoull(p, &end, 10);
            if (end == p || errno) {
                fprintf(stderr, "tierkv-replay: %s:%zu: malformed hash_ids\n", path, lineno);
                free(r.ids);
                rc = -1;
                goto out;
            }
            if (r.num_ids == rcap) {
                rcap = rcap ? rcap * 2 : 16;
                r.ids = realloc(r.ids, rcap * sizeof(*r.ids));
                if (!r.ids) {
                    fprintf(stderr, "tierkv-replay: out of memory\n");
                    abort();
                }
            }
            r.ids[r.num_ids++] = v;
            if (v > t->max_id)
                t->max_id = v;
            p = end;
        }
        if (t->num == t->cap) {
            t->cap = t->cap ? t->cap * 2 : 1024;
            t->req = realloc(t->req, t->cap * sizeof(*t->req));
            if (!t->req) {
                fprintf(stderr, "tierkv-replay: out of memory\n");
                abort();
            }
        }
        t->req[t->num++] = r;
    }
out:
    free(line);
    if (rc == 0 && t->num == 0) {
        fprintf(stderr, "tierkv-replay: %s holds no requests\n", path);
        rc = -1;
    }
    return rc;
}

static void trace_free(trace *t)
{
    for (size_t i = 0; i < t->num; i++)
        free(t->req[i].ids);
    free(t->req);
}

/* Infinite-cache hits of trace blocks: for each request, the leading run of ids seen in
 * earlier requests. */
static void infinite_cache(const trace *t, uint64_t *hits, uint64_t *total)
{
    uint8_t *seen = calloc(t->max_id / 8 + 1, 1);
    if (!seen)
        abort();
    *hits = *total = 0;
    for (size_t i = 0; i < t->num; i++) {
        const request *r = &t->req[i];
        bool run = true;
        for (uint32_t k = 0; k < r->num_ids; k++) {
            uint64_t id = r->ids[k];
            if (run && (seen[id >> 3] & (1u << (id & 7))))
                (*hits)++;
            else
                run = false;
        }
        *total += r->num_ids;
        for (uint32_t k = 0; k < r->num_ids; k++)
            seen[r->ids[k] >> 3] |= (uint8_t)(1u << (r->ids[k] & 7));
    }
    free(seen);
}

/* =========================================================================================
 * replay
 * ========================================================================================= */

typedef struct counters {
    uint64_t requests, trace_blocks, trace_hits;
    uint64_t cache_blocks, cache_hits, tier_hits[4];
    uint64_t put_blocks, put_stored, put_dup, put_rejected, get_blocks, mismatches;
    uint64_t mapped_blocks;
    uint64_t bytes_put, bytes_got;
    double lookup_s, get_s, put_s;
} counters;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static volatile sig_atomic_t g_stop;
static void on_signal(int sig) { (void)sig; g_stop = 1; }

static int fail_call(const char *what, size_t ireq, int rc)
{
    fprintf(stderr, "tierkv-replay: request %zu: %s: %s\n", ireq, what, kvc_last_error());
    return rc;
}

static int replay_one(kvc_client *c, const request *r, size_t ireq, bool prefetch,
                      counters *k, uint32_t **tok_buf, size_t *tok_cap, uint8_t **buf,
                      size_t *buf_cap, uint8_t *expect)
{
    const uint32_t P = kvc_block_tokens(c);
    const uint32_t sub = TRACE_BLOCK_TOKENS / P;
    const size_t bb = kvc_block_bytes(c);
    size_t ntok = (size_t)r->num_ids * TRACE_BLOCK_TOKENS;
    uint32_t nblocks = r->num_ids * sub;
    if (ntok > *tok_cap) {
        *tok_cap = ntok;
        *tok_buf = realloc(*tok_buf, ntok * sizeof(uint32_t));
        if (!*tok_buf)
            abort();
    }
    if ((size_t)nblocks * bb > *buf_cap) {
        *buf_cap = (size_t)nblocks * bb;
        *buf = realloc(*buf, *buf_cap);
        if (!*buf)
            abort();
    }
    uint32_t *tokens = *tok_buf;
    for (uint32_t i = 0; i < r->num_ids; i++)
        for (uint32_t j = 0; j < TRACE_BLOCK_TOKENS; j++)
            tokens[(size_t)i * TRACE_BLOCK_TOKENS + j] = trace_token(r->ids[i], j);

    double t0 = now_s();
    kvc_lease *l = NULL;
    int rc = kvc_lookup(c, tokens, ntok, 0, &l);
    if (rc != KVC_OK)
        return fail_call("lookup", ireq, rc);
    uint32_t hit = kvc_lease_num_blocks(l);
    if (hit > nblocks || kvc_lease_num_query_blocks(l) != nblocks) {
        fprintf(stderr, "tierkv-replay: request %zu: lookup says %u of %u blocks (asked %u)\n",
                ireq, hit, kvc_lease_num_query_blocks(l), nblocks);
        kvc_release(c, l);
        return KVC_EPROTO;
    }
    k->cache_blocks += nblocks;
    k->cache_hits += hit;
    for (uint32_t i = 0; i < hit; i++)
        k->tier_hits[kvc_lease_tier(l, i) & 3]++;
    k->trace_blocks += r->num_ids;
    k->trace_hits += hit / sub;

    if (hit > 0) {
        /* an engine promotes what it is about to read, then reads it */
        if (prefetch) {
            rc = kvc_prefetch(c, l, KVC_TIER_L2, NULL);
            if (rc == KVC_OK)
                rc = kvc_wait(c, l, KVC_TIER_L2, 30000);
            if (rc != KVC_OK) {
                kvc_release(c, l);
                return fail_call("prefetch", ireq, rc);
            }
            hit = kvc_lease_num_blocks(l);
        }
        double tg = now_s();
        k->lookup_s += tg - t0;
        for (uint32_t i = 0; i < hit; i++)
            if (kvc_lease_block_ptr(c, l, i))
                k->mapped_blocks++;
        rc = kvc_get(c, l, 0, hit, *buf, *buf_cap);
        if (rc != KVC_OK) {
            kvc_release(c, l);
            return fail_call("get", ireq, rc);
        }
        k->get_s += now_s() - tg;
        k->get_blocks += hit;
        k->bytes_got += (uint64_t)hit * bb;
        for (uint32_t i = 0; i < hit; i++) {
            fill_block(expect, bb, r->ids[i / sub], i % sub);
            if (memcmp(expect, *buf + (size_t)i * bb, bb) != 0) {
                if (k->mismatches < 5)
                    fprintf(stderr, "tierkv-replay: request %zu: block %u (trace id %" PRIu64
                                    ", sub %u) differs from what was put\n",
                            ireq, i, r->ids[i / sub], i % sub);
                k->mismatches++;
            }
        }
    } else {
        k->lookup_s += now_s() - t0;
    }

    rc = kvc_release(c, l);
    if (rc != KVC_OK)
        return fail_call("release", ireq, rc);

    if (hit < nblocks) {
        double tp = now_s();
        uint32_t miss = nblocks - hit;
        for (uint32_t i = hit; i < nblocks; i++)
            fill_block(*buf + (size_t)(i - hit) * bb, bb, r->ids[i / sub], i % sub);
        kvc_put_result pr;
        rc = kvc_put(c, tokens, ntok, hit, *buf, miss, &pr);
        if (rc != KVC_OK)
            return fail_call("put", ireq, rc);
        k->put_s += now_s() - tp;
        k->put_blocks += miss;
        k->put_stored += pr.num_stored;
        k->put_dup += pr.num_duplicate;
        k->put_rejected += pr.num_rejected;
        k->bytes_put += (uint64_t)miss * bb;
    }
    k->requests++;
    return KVC_OK;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tierkv-replay --trace FILE [options]\n"
            "\n"
            "Replays a Mooncake-format trace through libkvclient like an engine: lookup, prefetch\n"
            "to L2 and get the hit blocks (checked bit-exact), put the missing ones.\n"
            "\n"
            "  --socket PATH        tierkvd's gRPC socket (default $TIERKV_SOCKET)\n"
            "  --attach PATH        attach socket: map the L2 pool and get hits by memcpy\n"
            "  --trace FILE         JSON lines with hash_ids (data/mooncake_conversation_trace.jsonl)\n"
            "  --requests N         replay the first N requests (default 1000; 0 = all)\n"
            "  --loop N             replay them N times (default 1; 0 = until interrupted)\n"
            "  --rate R             at most R requests per second (default 0 = as fast as possible)\n"
            "  --no-prefetch        get hit blocks without promoting them first\n"
            "  --geometry L,H,D,P,MODEL  check this geometry (layers, kv heads, head dim, block\n"
            "                       tokens, model id; fp8_e4m3 per_tensor) against the daemon's\n"
            "                       (default: use the daemon's)\n"
            "  --expect-exact       exit 2 unless the hit rate equals the trace's infinite-cache value\n"
            "  --json               print the summary as one JSON object\n"
            "\n"
            "Exit status: 0 ok, 1 usage, 2 hit rate differs (with --expect-exact), 3 daemon\n"
            "unreachable, 4 a get was not bit-exact, 5 a call failed.\n");
}

int main(int argc, char **argv)
{
    const char *sock = NULL, *attach = NULL, *trace_path = NULL, *geometry = NULL;
    unsigned long requests = 1000, loops = 1;
    double rate = 0;
    bool prefetch = true, expect_exact = false, json = false;
    static const struct option lopts[] = {
        {"socket", required_argument, 0, 's'},   {"attach", required_argument, 0, 'a'},
        {"trace", required_argument, 0, 't'},    {"requests", required_argument, 0, 'n'},
        {"loop", required_argument, 0, 'l'},     {"rate", required_argument, 0, 'r'},
        {"no-prefetch", no_argument, 0, 'P'},    {"geometry", required_argument, 0, 'g'},
        {"expect-exact", no_argument, 0, 'x'},   {"json", no_argument, 0, 'j'},
        {"help", no_argument, 0, 'h'},           {0, 0, 0, 0}};
    int ch;
    while ((ch = getopt_long(argc, argv, "h", lopts, NULL)) != -1) {
        char *end;
        switch (ch) {
        case 's': sock = optarg; break;
        case 'a': attach = optarg; break;
        case 't': trace_path = optarg; break;
        case 'n':
        case 'l': {
            errno = 0;
            unsigned long v = strtoul(optarg, &end, 10);
            if (errno || end == optarg || *end || optarg[0] == '-') {
                fprintf(stderr, "tierkv-replay: --%s wants a number, got '%s'\n",
                        ch == 'n' ? "requests" : "loop", optarg);
                return 1;
            }
            *(ch == 'n' ? &requests : &loops) = v;
            break;
        }
        case 'r':
            rate = strtod(optarg, &end);
            if (end == optarg || *end || rate < 0) {
                fprintf(stderr, "tierkv-replay: --rate wants requests per second, got '%s'\n",
                        optarg);
                return 1;
            }
            break;
        case 'P': prefetch = false; break;
        case 'g': geometry = optarg; break;
        case 'x': expect_exact = true; break;
        case 'j': json = true; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 1;
        }
    }
    if (!trace_path || optind != argc) {
        usage(stderr);
        return 1;
    }

    int exit_code = 0;
    trace t;
    kvc_client *c = NULL;
    uint32_t *tok = NULL;
    uint8_t *buf = NULL, *expect = NULL;
    size_t tok_cap = 0, buf_cap = 0;
    if (trace_load(trace_path, requests, &t) != 0)
        return 1;

    kvc_opts *o = kvc_opts_new();
    int rc = KVC_OK;
    if (sock)
        rc = kvc_opts_set_socket(o, sock);
    if (rc == KVC_OK && attach)
        rc = kvc_opts_set_attach_socket(o, attach);
    if (rc == KVC_OK && geometry) {
        unsigned L, H, D, P;
        char model[128];
        if (sscanf(geometry, "%u,%u,%u,%u,%127s", &L, &H, &D, &P, model) != 5) {
            fprintf(stderr, "tierkv-replay: --geometry wants L,H,D,P,MODEL, got '%s'\n", geometry);
            kvc_opts_free(o);
            exit_code = 1;
            goto out;
        }
        rc = kvc_opts_set_geometry(o, L, H, D, P, "fp8_e4m3", "per_tensor", model);
    }
    if (rc != KVC_OK) {
        fprintf(stderr, "tierkv-replay: %s\n", kvc_last_error());
        kvc_opts_free(o);
        exit_code = 1;
        goto out;
    }
    rc = kvc_connect(o, &c);
    kvc_opts_free(o);
    if (rc != KVC_OK) {
        fprintf(stderr, "tierkv-replay: %s\n", kvc_last_error());
        exit_code = (rc == KVC_EUNAVAILABLE || rc == KVC_ETIMEDOUT) ? 3 : 5;
        goto out;
    }
    if (TRACE_BLOCK_TOKENS % kvc_block_tokens(c) != 0) {
        fprintf(stderr, "tierkv-replay: block_tokens %u does not divide 512\n",
                kvc_block_tokens(c));
        exit_code = 1;
        goto out;
    }
    expect = malloc(kvc_block_bytes(c));
    if (!expect)
        abort();

    uint64_t inf_hits, inf_total;
    infinite_cache(&t, &inf_hits, &inf_total);

    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    counters k;
    memset(&k, 0, sizeof(k));
    double t0 = now_s();
    for (unsigned long pass = 0; !g_stop && (loops == 0 || pass < loops); pass++) {
        for (size_t i = 0; i < t.num && !g_stop; i++) {
            if (rate > 0) {
                double due = t0 + (double)k.requests / rate, wait = due - now_s();
                if (wait > 0) {
                    struct timespec d = {(time_t)wait, (long)((wait - (time_t)wait) * 1e9)};
                    nanosleep(&d, NULL);
                }
            }
            rc = replay_one(c, &t.req[i], i, prefetch, &k, &tok, &tok_cap, &buf, &buf_cap,
                            expect);
            if (rc != KVC_OK) {
                exit_code = (rc == KVC_EUNAVAILABLE || rc == KVC_ETIMEDOUT) ? 3 : 5;
                goto summary;
            }
        }
        if (pass == 0 && loops != 1 && !json) {
            /* later passes hit everything: report the first pass's rate on its own */
            printf("pass 1: hit rate %.1f%% of trace blocks\n",
                   100.0 * (double)k.trace_hits / (double)(k.trace_blocks ? k.trace_blocks : 1));
            fflush(stdout);
        }
    }
summary:;
    double wall = now_s() - t0;
    double hit_pct = k.trace_blocks ? 100.0 * (double)k.trace_hits / (double)k.trace_blocks : 0;
    double inf_pct = inf_total ? 100.0 * (double)inf_hits / (double)inf_total : 0;
    double tiers[4];
    for (int i = 0; i < 4; i++)
        tiers[i] = k.cache_blocks ? 100.0 * (double)k.tier_hits[i] / (double)k.cache_blocks : 0;
    char measured[16], expected[16];
    snprintf(measured, sizeof(measured), "%.1f", hit_pct);
    snprintf(expected, sizeof(expected), "%.1f", inf_pct);
    bool complete = (loops == 1 && k.requests == t.num);
    if (json) {
        printf("{\"requests\":%" PRIu64 ",\"trace_blocks\":%" PRIu64 ",\"trace_hit_blocks\":%" PRIu64
               ",\"hit_rate\":%.4f,\"infinite_cache_hit_rate\":%.4f,\"cache_blocks\":%" PRIu64
               ",\"cache_hit_blocks\":%" PRIu64 ",\"hit_l1\":%.4f,\"hit_l2\":%.4f,\"hit_l3\":%.4f,"
               "\"put_blocks\":%" PRIu64 ",\"put_stored\":%" PRIu64 ",\"put_rejected\":%" PRIu64
               ",\"get_blocks\":%" PRIu64 ",\"mapped_blocks\":%" PRIu64 ",\"mismatches\":%" PRIu64
               ",\"wall_s\":%.3f,\"requests_per_s\":%.1f,\"put_mb_per_s\":%.1f,"
               "\"get_mb_per_s\":%.1f}\n",
               k.requests, k.trace_blocks, k.trace_hits, hit_pct / 100, inf_pct / 100,
               k.cache_blocks, k.cache_hits, tiers[1] / 100, tiers[2] / 100, tiers[3] / 100,
               k.put_blocks, k.put_stored, k.put_rejected, k.get_blocks, k.mapped_blocks,
               k.mismatches, wall, k.requests / (wall > 0 ? wall : 1),
               k.put_s > 0 ? k.bytes_put / k.put_s / 1e6 : 0,
               k.get_s > 0 ? k.bytes_got / k.get_s / 1e6 : 0);
    } else {
        printf("replayed %" PRIu64 " requests (%" PRIu64 " trace blocks of 512 tokens = %" PRIu64
               " cache blocks of %u tokens, %zu bytes each) in %.1f s: %.1f requests/s\n",
               k.requests, k.trace_blocks, k.cache_blocks, c ? kvc_block_tokens(c) : 0,
               c ? kvc_block_bytes(c) : 0, wall, k.requests / (wall > 0 ? wall : 1));
        printf("hit rate: %s%% (trace infinite-cache value: %s%%)\n", measured, expected);
        printf("hits by tier at lookup (share of cache blocks asked): L1 %.1f%%, L2 %.1f%%, "
               "L3 %.1f%%\n",
               tiers[1], tiers[2], tiers[3]);
        printf("lookup+prefetch %.2f s, get %" PRIu64 " blocks (%" PRIu64
               " through the mapped pool) %.1f MB/s, put %" PRIu64 " blocks %.1f MB/s "
               "(%" PRIu64 " stored, %" PRIu64 " duplicate, %" PRIu64 " rejected)\n",
               k.lookup_s, k.get_blocks, k.mapped_blocks,
               k.get_s > 0 ? k.bytes_got / k.get_s / 1e6 : 0, k.put_blocks,
               k.put_s > 0 ? k.bytes_put / k.put_s / 1e6 : 0, k.put_stored, k.put_dup,
               k.put_rejected);
        printf("bit-exact check: %" PRIu64 " blocks read back, %" PRIu64 " mismatches\n",
               k.get_blocks, k.mismatches);
    }
    if (exit_code == 0 && k.mismatches)
        exit_code = 4;
    if (exit_code == 0 && expect_exact && complete && k.trace_hits != inf_hits) {
        fprintf(stderr, "tierkv-replay: hit rate %s%% differs from the infinite-cache %s%%\n",
                measured, expected);
        exit_code = 2;
    }
out:
    free(tok);
    free(buf);
    free(expect);
    kvc_close(c);
    trace_free(&t);
    return exit_code;
}

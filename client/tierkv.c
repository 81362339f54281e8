/* tierkv.c - the operator's CLI for tierkvd: status, top, lookup, blocks, evict, flush,
 * verify, health. Uses only the public libkvclient API. Exit codes are part of the interface
 * (documented in usage() and docs/cli.md); scripts depend on them.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvclient.h"

enum {
    EXIT_OK = 0,
    EXIT_USAGE = 1,       /* bad command line or unreadable/malformed token input */
    EXIT_NOTFOUND = 2,    /* lookup: no block hit; evict with tokens: nothing evicted */
    EXIT_UNREACHABLE = 3, /* the daemon cannot be reached (or timed out) */
    EXIT_GEOMETRY = 4,    /* the daemon's geometry differs from the one asked for */
    EXIT_FAILED = 5,      /* the daemon answered the request with an error */
    EXIT_BAD_BLOCKS = 6,  /* verify found blocks that failed their checksum */
};

static const char *const kExitCodes =
    "Exit codes:\n"
    "  0  success\n"
    "  1  usage error (bad command line, unreadable or malformed token input)\n"
    "  2  not found: lookup hit no block; evict --tokens evicted nothing\n"
    "  3  daemon unreachable or timed out\n"
    "  4  geometry mismatch between the client and the daemon\n"
    "  5  the daemon answered with an error\n"
    "  6  verify found blocks that failed their checksum\n";

/* =========================================================================================
 * help
 * ========================================================================================= */

typedef struct cmd_help {
    const char *name, *synopsis, *text;
} cmd_help;

static const cmd_help kHelp[] = {
    {"status", "tierkv status [--json]",
     "Daemon health, geometry, tiers (blocks, bytes, occupancy, hits), counters and lookup\n"
     "latency.\n"},
    {"top", "tierkv top [--interval SECONDS] [--count N] [--json]",
     "A refreshing view: hit rate per tier, tokens saved per second, occupancy,\n"
     "promotions/demotions per second, lookup latency p50/p99, checksum failures, I/O errors.\n"
     "--interval  seconds between refreshes (default 1, fractions allowed)\n"
     "--count     stop after N refreshes (default: until interrupted)\n"
     "--json      one JSON object per refresh, one per line\n"},
    {"lookup", "tierkv lookup [FILE|-] [--json]",
     "Reads token ids (unsigned 32-bit, separated by whitespace or commas) from FILE or stdin,\n"
     "asks the daemon for the longest cached prefix and prints how many blocks hit and in which\n"
     "tier each one is. The lease the lookup takes is released before exit.\n"
     "Exits 2 when no block hit.\n"},
    {"blocks", "tierkv blocks [--tier all|l2|l3] [--limit N] [--json]",
     "Lists cached blocks: key, parent, depth, state, residency, pins, hits, last access.\n"
     "--limit  at most N blocks (default 100; 0 = the daemon's maximum)\n"},
    {"evict", "tierkv evict --tier l2|l3 [--tokens FILE|-] [--json]",
     "Evicts every unpinned block from the tier, or with --tokens only that prompt's blocks.\n"
     "Blocks pinned by a lease stay and are counted. Exits 2 when --tokens evicted nothing.\n"},
    {"flush", "tierkv flush", "Waits until every pending write-back has reached L3.\n"},
    {"verify", "tierkv verify [--json] [--no-progress]",
     "Re-reads every block and checks its checksum, with a progress bar on stderr. Bad blocks\n"
     "are dropped by the daemon. Exits 6 when any block was bad.\n"},
    {"health", "tierkv health [--json]", "serving | degraded | stopping, version and notes.\n"},
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tierkv [global options] COMMAND [options]\n"
            "\n"
            "Operate tierkvd, the tiered KV-cache daemon.\n"
            "\n"
            "Commands:\n");
    for (size_t i = 0; i < sizeof(kHelp) / sizeof(kHelp[0]); i++)
        fprintf(f, "  %s\n", kHelp[i].synopsis);
    fprintf(f,
            "\n"
            "Global options:\n"
            "  --socket PATH     the daemon's gRPC UNIX socket (default $TIERKV_SOCKET,\n"
            "                    else /run/tierkv/tierkv.sock)\n"
            "  --target ADDR     any gRPC target instead, e.g. 127.0.0.1:7700\n"
            "  --namespace NS    tenant namespace for lookup/evict (default \"\")\n"
            "  --timeout MS      per-call deadline (default 10000)\n"
            "  --json            machine-readable output (every read command)\n"
            "  --help            this text; `tierkv COMMAND --help` for a command\n"
            "\n%s"
            "See docs/cli.md.\n",
            kExitCodes);
}

static int command_help(const char *cmd, FILE *f)
{
    for (size_t i = 0; i < sizeof(kHelp) / sizeof(kHelp[0]); i++) {
        if (strcmp(kHelp[i].name, cmd) == 0) {
            fprintf(f, "usage: %s\n\n%s\nGlobal options (--socket, --target, --namespace, "
                       "--timeout) apply; see `tierkv --help`.\n\n%s",
                    kHelp[i].synopsis, kHelp[i].text, kExitCodes);
            return 1;
        }
    }
    return 0;
}

/* =========================================================================================
 * options and helpers
 * ========================================================================================= */

typedef struct cli {
    const char *socket, *target, *ns;
    unsigned long timeout_ms;
    int json, no_progress;
    double interval_s;
    long count;
    int tier;
    int tier_given;
    unsigned long limit;
    const char *tokens_path;
    const char *file;
} cli;

static int exit_for(int rc)
{
    switch (rc) {
    case KVC_OK: return EXIT_OK;
    case KVC_EUNAVAILABLE:
    case KVC_ETIMEDOUT: return EXIT_UNREACHABLE;
    case KVC_EGEOMETRY: return EXIT_GEOMETRY;
    case KVC_ENOTFOUND: return EXIT_NOTFOUND;
    default: return EXIT_FAILED;
    }
}

static int report(int rc)
{
    fprintf(stderr, "tierkv: %s\n", kvc_last_error()[0] ? kvc_last_error() : kvc_strerror(rc));
    return exit_for(rc);
}

static int parse_tier(const char *s, int *tier)
{
    if (strcasecmp(s, "all") == 0 || strcasecmp(s, "none") == 0)
        *tier = KVC_TIER_NONE;
    else if (strcasecmp(s, "l1") == 0)
        *tier = KVC_TIER_L1;
    else if (strcasecmp(s, "l2") == 0)
        *tier = KVC_TIER_L2;
    else if (strcasecmp(s, "l3") == 0)
        *tier = KVC_TIER_L3;
    else
        return -1;
    return 0;
}

/* Reads unsigned 32-bit token ids separated by whitespace or commas. Returns 0, or -1 with
 * a message on stderr. */
static int read_tokens(const char *path, uint32_t **out, size_t *num)
{
    FILE *f = stdin;
    if (path && strcmp(path, "-") != 0) {
        f = fopen(path, "r");
        if (!f) {
            fprintf(stderr, "tierkv: cannot open %s: %s\n", path, strerror(errno));
            return -1;
        }
    }
    size_t cap = 1024, n = 0;
    uint32_t *t = malloc(cap * sizeof(*t));
    char word[32];
    size_t wlen = 0;
    int rc = 0, ch;
    size_t pos = 0;
    if (!t) {
        fprintf(stderr, "tierkv: out of memory\n");
        rc = -1;
        goto done;
    }
    for (;;) {
        ch = fgetc(f);
        pos++;
        int sep = (ch == EOF || ch == ',' || ch == ' ' || ch == '\t' || ch == '\n' ||
                   ch == '\r');
        if (!sep) {
            if (ch < '0' || ch > '9' || wlen + 1 >= sizeof(word)) {
                fprintf(stderr, "tierkv: token input: unexpected '%c' at byte %zu (tokens are "
                                "unsigned integers separated by whitespace or commas)\n",
                        ch, pos);
                rc = -1;
                goto done;
            }
            word[wlen++] = (char)ch;
            continue;
        }
        if (wlen) {
            word[wlen] = '\0';
            unsigned long long v = strtoull(word, NULL, 10);
            if (v > UINT32_MAX) {
                fprintf(stderr, "tierkv: token input: %s is larger than 2^32-1\n", word);
                rc = -1;
                goto done;
            }
            if (n == cap) {
                cap *= 2;
                uint32_t *nt = realloc(t, cap * sizeof(*t));
                if (!nt) {
                    fprintf(stderr, "tierkv: out of memory\n");
                    rc = -1;
                    goto done;
                }
                t = nt;
            }
            t[n++] = (uint32_t)v;
            wlen = 0;
        }
        if (ch == EOF)
            break;
    }
    if (ferror(f)) {
        fprintf(stderr, "tierkv: reading tokens: %s\n", strerror(errno));
        rc = -1;
    }
done:
    if (f != stdin)
        fclose(f);
    if (rc != 0) {
        free(t);
        return rc;
    }
    *out = t;
    *num = n;
    return 0;
}

static void json_str(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            printf("\\%c", ch);
        else if (ch < 0x20)
            printf("\\u%04x", ch);
        else
            putchar(ch);
    }
    putchar('"');
}

static double pct(uint64_t a, uint64_t b) { return b ? 100.0 * (double)a / (double)b : 0.0; }

/* A tier without a capacity limit reports 0 or UINT64_MAX blocks. */
static int unbounded(uint64_t capacity_blocks)
{
    return capacity_blocks == 0 || capacity_blocks == UINT64_MAX;
}

/* Occupancy 0..1, or -1 for an unbounded tier (printed as null in JSON). */
static double occupancy(const kvc_tier_stats *t)
{
    return unbounded(t->capacity_blocks) ? -1.0 : (double)t->blocks / (double)t->capacity_blocks;
}

/* =========================================================================================
 * commands
 * ========================================================================================= */

static int cmd_status(kvc_client *c, const cli *o)
{
    kvc_stats s;
    kvc_health h;
    int rc = kvc_health_get(c, &h);
    if (rc == KVC_OK)
        rc = kvc_stats_get(c, &s);
    if (rc != KVC_OK)
        return report(rc);
    uint64_t asked = s.hit_blocks + s.miss_blocks;
    if (o->json) {
        printf("{\"status\":");
        json_str(h.status);
        printf(",\"version\":");
        json_str(h.version);
        printf(",\"notes\":");
        json_str(h.notes);
        printf(",\"uptime_s\":%" PRIu64 ",\"policy\":", s.uptime_s);
        json_str(s.policy);
        printf(",\"geometry\":{\"model_id\":");
        json_str(s.model_id);
        printf(",\"num_layers\":%u,\"num_kv_heads\":%u,\"head_dim\":%u,\"block_tokens\":%u,"
               "\"kv_dtype\":",
               s.num_layers, s.num_kv_heads, s.head_dim, s.block_tokens);
        json_str(s.kv_dtype);
        printf(",\"scale_mode\":");
        json_str(s.scale_mode);
        printf(",\"block_bytes\":%" PRIu64 "},\"tiers\":[", s.block_bytes);
        int first = 1;
        for (int t = KVC_TIER_L1; t <= KVC_TIER_L3; t++) {
            const kvc_tier_stats *ts = &s.tiers[t];
            if (!ts->capacity_blocks && !ts->blocks && !ts->hit_blocks)
                continue;
            printf("%s{\"tier\":\"%s\",\"blocks\":%" PRIu64 ",\"bytes\":%" PRIu64
                   ",\"capacity_blocks\":%" PRIu64 ",\"hit_blocks\":%" PRIu64 "}",
                   first ? "" : ",", kvc_tier_name(t), ts->blocks, ts->bytes, ts->capacity_blocks,
                   ts->hit_blocks);
            first = 0;
        }
        printf("],\"lookups\":%" PRIu64 ",\"hit_blocks\":%" PRIu64 ",\"miss_blocks\":%" PRIu64
               ",\"hit_rate\":%.4f,\"hit_tokens\":%" PRIu64 ",\"puts\":%" PRIu64
               ",\"put_blocks\":%" PRIu64 ",\"gets\":%" PRIu64 ",\"get_bytes\":%" PRIu64
               ",\"promotions\":%" PRIu64 ",\"promotion_bytes\":%" PRIu64 ",\"demotions\":%" PRIu64
               ",\"demotion_bytes\":%" PRIu64 ",\"evictions\":%" PRIu64
               ",\"checksum_failures\":%" PRIu64 ",\"io_errors\":%" PRIu64
               ",\"leases_active\":%" PRIu64 ",\"clients_connected\":%" PRIu64
               ",\"lookup_p50_us\":%.1f,\"lookup_p99_us\":%.1f,\"l3_readonly\":%s}\n",
               s.lookups, s.hit_blocks, s.miss_blocks, asked ? (double)s.hit_blocks / asked : 0.0,
               s.hit_tokens, s.puts, s.put_blocks, s.gets, s.get_bytes, s.promotions,
               s.promotion_bytes, s.demotions, s.demotion_bytes, s.evictions, s.checksum_failures,
               s.io_errors, s.leases_active, s.clients_connected, s.lookup_p50_us, s.lookup_p99_us,
               s.l3_readonly ? "true" : "false");
        return EXIT_OK;
    }
    printf("tierkvd %s  %s  up %" PRIu64 "s  policy %s\n", h.version, h.status, s.uptime_s,
           s.policy);
    if (h.notes[0])
        printf("notes: %s\n", h.notes);
    printf("model %s: %u layers, %u kv heads, head dim %u, %u tokens/block, %s, %s, %" PRIu64
           " bytes/block\n",
           s.model_id, s.num_layers, s.num_kv_heads, s.head_dim, s.block_tokens, s.kv_dtype,
           s.scale_mode, s.block_bytes);
    printf("%-5s %12s %14s %12s %9s %12s\n", "tier", "blocks", "bytes", "capacity", "used",
           "hit blocks");
    for (int t = KVC_TIER_L1; t <= KVC_TIER_L3; t++) {
        const kvc_tier_stats *ts = &s.tiers[t];
        if (!ts->capacity_blocks && !ts->blocks && !ts->hit_blocks)
            continue;
        char cap[24], used[16];
        if (unbounded(ts->capacity_blocks)) {
            snprintf(cap, sizeof(cap), "unlimited");
            snprintf(used, sizeof(used), "-");
        } else {
            snprintf(cap, sizeof(cap), "%" PRIu64, ts->capacity_blocks);
            snprintf(used, sizeof(used), "%.1f%%", pct(ts->blocks, ts->capacity_blocks));
        }
        printf("%-5s %12" PRIu64 " %14" PRIu64 " %12s %9s %12" PRIu64 "%s\n", kvc_tier_name(t),
               ts->blocks, ts->bytes, cap, used, ts->hit_blocks,
               t == KVC_TIER_L3 && s.l3_readonly ? "  (read-only)" : "");
    }
    printf("lookups %" PRIu64 ", blocks hit %" PRIu64 " / %" PRIu64 " (%.1f%%), tokens saved %" PRIu64
           "\n",
           s.lookups, s.hit_blocks, asked, pct(s.hit_blocks, asked), s.hit_tokens);
    printf("puts %" PRIu64 " (%" PRIu64 " blocks), gets %" PRIu64 " (%" PRIu64 " bytes)\n", s.puts,
           s.put_blocks, s.gets, s.get_bytes);
    printf("promotions %" PRIu64 " (%" PRIu64 " bytes), demotions %" PRIu64 " (%" PRIu64
           " bytes), evictions %" PRIu64 "\n",
           s.promotions, s.promotion_bytes, s.demotions, s.demotion_bytes, s.evictions);
    printf("checksum failures %" PRIu64 ", I/O errors %" PRIu64 "\n", s.checksum_failures,
           s.io_errors);
    printf("leases %" PRIu64 ", clients %" PRIu64 ", lookup latency p50 %.1f us, p99 %.1f us\n",
           s.leases_active, s.clients_connected, s.lookup_p50_us, s.lookup_p99_us);
    return EXIT_OK;
}

static volatile sig_atomic_t g_stop;
static void on_sigint(int sig) { (void)sig; g_stop = 1; }

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int cmd_top(kvc_client *c, const cli *o)
{
    kvc_stats prev, cur;
    int rc = kvc_stats_get(c, &prev);
    if (rc != KVC_OK)
        return report(rc);
    double t_prev = now_s();
    int tty = isatty(STDOUT_FILENO) && !o->json;
    signal(SIGINT, on_sigint);
    for (long i = 0; !g_stop && (o->count <= 0 || i < o->count); i++) {
        struct timespec d = {.tv_sec = (time_t)o->interval_s,
                             .tv_nsec = (long)((o->interval_s - (time_t)o->interval_s) * 1e9)};
        while (nanosleep(&d, &d) != 0 && errno == EINTR && !g_stop)
            ;
        if (g_stop)
            break;
        rc = kvc_stats_get(c, &cur);
        if (rc != KVC_OK)
            return report(rc);
        double t = now_s(), dt = t - t_prev;
        if (dt <= 0)
            dt = 1e-9;
        uint64_t asked = (cur.hit_blocks + cur.miss_blocks) - (prev.hit_blocks + prev.miss_blocks);
        double hit[4];
        for (int k = 0; k < 4; k++)
            hit[k] = pct(cur.tiers[k].hit_blocks - prev.tiers[k].hit_blocks, asked);
        double all_hit = pct(cur.hit_blocks - prev.hit_blocks, asked);
        double saved_s = (double)(cur.hit_tokens - prev.hit_tokens) / dt;
        double lookups_s = (double)(cur.lookups - prev.lookups) / dt;
        double promo_s = (double)(cur.promotions - prev.promotions) / dt;
        double demo_s = (double)(cur.demotions - prev.demotions) / dt;
        if (o->json) {
            printf("{\"interval_s\":%.3f,\"lookups_per_s\":%.1f,\"hit_rate\":%.4f,"
                   "\"hit_rate_l1\":%.4f,\"hit_rate_l2\":%.4f,\"hit_rate_l3\":%.4f,"
                   "\"tokens_saved_per_s\":%.1f,\"occupancy_l2\":%.4f,\"occupancy_l3\":%.4f,"
                   "\"promotions_per_s\":%.1f,\"demotions_per_s\":%.1f,\"lookup_p50_us\":%.1f,"
                   "\"lookup_p99_us\":%.1f,\"checksum_failures\":%" PRIu64
                   ",\"io_errors\":%" PRIu64 ",\"leases_active\":%" PRIu64 "}\n",
                   dt, lookups_s, all_hit / 100, hit[1] / 100, hit[2] / 100, hit[3] / 100, saved_s,
                   occupancy(&cur.tiers[2]), occupancy(&cur.tiers[3]), promo_s, demo_s,
                   cur.lookup_p50_us, cur.lookup_p99_us, cur.checksum_failures, cur.io_errors,
                   cur.leases_active);
        } else {
            if (tty)
                printf("\033[H\033[2J");
            printf("tierkv top  (every %.1fs, ctrl-c to quit)  model %s  up %" PRIu64 "s\n\n",
                   o->interval_s, cur.model_id, cur.uptime_s);
            printf("lookups/s %10.1f   hit rate %5.1f%%  (L1 %5.1f%%  L2 %5.1f%%  L3 %5.1f%%)\n",
                   lookups_s, all_hit, hit[1], hit[2], hit[3]);
            printf("tokens saved/s %10.0f\n", saved_s);
            for (int k = KVC_TIER_L1; k <= KVC_TIER_L3; k++)
                if (cur.tiers[k].capacity_blocks || cur.tiers[k].blocks) {
                    if (unbounded(cur.tiers[k].capacity_blocks))
                        printf("occupancy %-3s %" PRIu64 " blocks (no limit)\n", kvc_tier_name(k),
                               cur.tiers[k].blocks);
                    else
                        printf("occupancy %-3s %5.1f%%  (%" PRIu64 " / %" PRIu64 " blocks)\n",
                               kvc_tier_name(k), 100 * occupancy(&cur.tiers[k]),
                               cur.tiers[k].blocks, cur.tiers[k].capacity_blocks);
                }
            printf("promotions/s %8.1f   demotions/s %8.1f   evictions %" PRIu64 "\n", promo_s,
                   demo_s, cur.evictions);
            printf("lookup latency p50 %.1f us  p99 %.1f us\n", cur.lookup_p50_us,
                   cur.lookup_p99_us);
            printf("checksum failures %" PRIu64 "   I/O errors %" PRIu64 "   leases %" PRIu64
                   "   clients %" PRIu64 "%s\n",
                   cur.checksum_failures, cur.io_errors, cur.leases_active, cur.clients_connected,
                   cur.l3_readonly ? "   L3 READ-ONLY" : "");
            if (!tty)
                printf("\n");
        }
        fflush(stdout);
        prev = cur;
        t_prev = t;
    }
    return EXIT_OK;
}

static int cmd_lookup(kvc_client *c, const cli *o)
{
    uint32_t *tokens = NULL;
    size_t n = 0;
    if (read_tokens(o->file, &tokens, &n) != 0)
        return EXIT_USAGE;
    kvc_lease *l = NULL;
    int rc = kvc_lookup(c, tokens, n, 0, &l);
    free(tokens);
    if (rc != KVC_OK)
        return report(rc);
    uint32_t hit = kvc_lease_num_blocks(l), q = kvc_lease_num_query_blocks(l);
    uint32_t per_tier[4] = {0, 0, 0, 0};
    for (uint32_t i = 0; i < hit; i++)
        per_tier[kvc_lease_tier(l, i) & 3]++;
    if (o->json) {
        printf("{\"tokens\":%zu,\"query_blocks\":%u,\"hit_blocks\":%u,\"hit_tokens\":%llu,"
               "\"l1\":%u,\"l2\":%u,\"l3\":%u,\"tiers\":[",
               n, q, hit, (unsigned long long)hit * kvc_block_tokens(c), per_tier[1], per_tier[2],
               per_tier[3]);
        for (uint32_t i = 0; i < hit; i++)
            printf("%s\"%s\"", i ? "," : "", kvc_tier_name(kvc_lease_tier(l, i)));
        printf("]}\n");
    } else {
        printf("%u of %u blocks hit (%llu of %zu tokens): L1 %u, L2 %u, L3 %u\n", hit, q,
               (unsigned long long)hit * kvc_block_tokens(c), n, per_tier[1], per_tier[2],
               per_tier[3]);
        if (hit) {
            printf("tiers:");
            for (uint32_t i = 0; i < hit; i++)
                printf(" %s", kvc_tier_name(kvc_lease_tier(l, i)));
            printf("\n");
        }
    }
    rc = kvc_release(c, l);
    if (rc != KVC_OK)
        return report(rc);
    return hit ? EXIT_OK : EXIT_NOTFOUND;
}

typedef struct blocks_ctx {
    int json, first;
} blocks_ctx;

static int print_block(void *arg, const kvc_block_info *b)
{
    blocks_ctx *x = arg;
    if (x->json) {
        printf("%s{\"key\":\"%s\",\"parent\":\"%s\",\"depth\":%u,\"state\":", x->first ? "" : ",",
               b->key_hex, b->parent_hex, b->depth);
        json_str(b->state);
        printf(",\"in_l2\":%s,\"in_l3\":%s,\"pins\":%u,\"hits\":%" PRIu64
               ",\"last_access_ms\":%" PRIu64 "}",
               b->in_l2 ? "true" : "false", b->in_l3 ? "true" : "false", b->pins, b->hits,
               b->last_access_ms);
    } else {
        printf("%.16s  %.16s  %5u  %-8s %s%s  %4u  %8" PRIu64 "\n", b->key_hex,
               b->parent_hex[0] ? b->parent_hex : "(root)          ", b->depth, b->state,
               b->in_l2 ? "L2" : "--", b->in_l3 ? "L3" : "--", b->pins, b->hits);
    }
    x->first = 0;
    return 0;
}

static int cmd_blocks(kvc_client *c, const cli *o)
{
    blocks_ctx x = {o->json, 1};
    uint64_t total = 0;
    if (o->json)
        printf("{\"blocks\":[");
    else
        printf("%-16s  %-16s  %5s  %-8s %-4s  %4s  %8s\n", "key", "parent", "depth", "state",
               "tier", "pins", "hits");
    int rc = kvc_list_blocks(c, o->tier, (uint32_t)o->limit, print_block, &x, &total);
    if (rc != KVC_OK) {
        if (o->json)
            printf("]}\n");
        return report(rc);
    }
    if (o->json)
        printf("],\"total\":%" PRIu64 "}\n", total);
    else
        printf("(%" PRIu64 " blocks in the cache)\n", total);
    return EXIT_OK;
}

static int cmd_evict(kvc_client *c, const cli *o)
{
    if (!o->tier_given || (o->tier != KVC_TIER_L2 && o->tier != KVC_TIER_L3)) {
        fprintf(stderr, "tierkv evict: --tier l2 or --tier l3 is required\n");
        return EXIT_USAGE;
    }
    uint32_t *tokens = NULL;
    size_t n = 0;
    if (o->tokens_path && read_tokens(o->tokens_path, &tokens, &n) != 0)
        return EXIT_USAGE;
    uint32_t evicted = 0, pinned = 0;
    int rc = kvc_evict(c, o->tier, tokens, n, &evicted, &pinned);
    free(tokens);
    if (rc != KVC_OK)
        return report(rc);
    if (o->json)
        printf("{\"tier\":\"%s\",\"evicted\":%u,\"pinned\":%u}\n", kvc_tier_name(o->tier), evicted,
               pinned);
    else
        printf("evicted %u blocks from %s (%u pinned, kept)\n", evicted, kvc_tier_name(o->tier),
               pinned);
    return (o->tokens_path && evicted == 0) ? EXIT_NOTFOUND : EXIT_OK;
}

static int cmd_flush(kvc_client *c, const cli *o)
{
    int rc = kvc_flush(c);
    if (rc != KVC_OK)
        return report(rc);
    if (o->json)
        printf("{\"flushed\":true}\n");
    else
        printf("flushed\n");
    return EXIT_OK;
}

typedef struct verify_ctx {
    int bar;
} verify_ctx;

static int verify_progress(void *arg, uint64_t done, uint64_t total, uint64_t bad)
{
    verify_ctx *v = arg;
    if (!v->bar)
        return 0;
    int width = 40, fill = total ? (int)((double)done / (double)total * width) : width;
    fprintf(stderr, "\rverify [");
    for (int i = 0; i < width; i++)
        fputc(i < fill ? '#' : '.', stderr);
    fprintf(stderr, "] %" PRIu64 "/%" PRIu64 "  bad %" PRIu64, done, total, bad);
    fflush(stderr);
    return 0;
}

static int cmd_verify(kvc_client *c, const cli *o)
{
    verify_ctx v = {!o->no_progress && isatty(STDERR_FILENO)};
    uint64_t bad = 0;
    int rc = kvc_verify(c, 0, verify_progress, &v, &bad);
    if (v.bar)
        fputc('\n', stderr);
    if (rc != KVC_OK)
        return report(rc);
    if (o->json)
        printf("{\"bad\":%" PRIu64 "}\n", bad);
    else
        printf("verify: %" PRIu64 " bad blocks%s\n", bad, bad ? " (dropped)" : "");
    return bad ? EXIT_BAD_BLOCKS : EXIT_OK;
}

static int cmd_health(kvc_client *c, const cli *o)
{
    kvc_health h;
    int rc = kvc_health_get(c, &h);
    if (rc != KVC_OK)
        return report(rc);
    if (o->json) {
        printf("{\"status\":");
        json_str(h.status);
        printf(",\"version\":");
        json_str(h.version);
        printf(",\"notes\":");
        json_str(h.notes);
        printf("}\n");
    } else {
        printf("%s (tierkvd %s)%s%s\n", h.status, h.version, h.notes[0] ? ": " : "", h.notes);
    }
    return EXIT_OK;
}

/* =========================================================================================
 * main
 * ========================================================================================= */

typedef struct command {
    const char *name;
    int (*fn)(kvc_client *, const cli *);
} command;

static const command kCommands[] = {
    {"status", cmd_status}, {"top", cmd_top},     {"lookup", cmd_lookup}, {"blocks", cmd_blocks},
    {"evict", cmd_evict},   {"flush", cmd_flush}, {"verify", cmd_verify}, {"health", cmd_health},
};

static int parse_ulong(const char *s, unsigned long max, unsigned long *out)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || end == s || *end || v > max || s[0] == '-')
        return -1;
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    cli o = {.timeout_ms = 10000, .interval_s = 1.0, .limit = 100, .tier = KVC_TIER_NONE};
    int help = 0;
    enum { O_SOCKET = 256, O_TARGET, O_NS, O_TIMEOUT, O_INTERVAL, O_COUNT, O_TIER, O_LIMIT,
           O_TOKENS, O_NOPROG };
    static const struct option lopts[] = {
        {"socket", required_argument, 0, O_SOCKET},   {"target", required_argument, 0, O_TARGET},
        {"namespace", required_argument, 0, O_NS},    {"timeout", required_argument, 0, O_TIMEOUT},
        {"json", no_argument, 0, 'j'},                {"help", no_argument, 0, 'h'},
        {"interval", required_argument, 0, O_INTERVAL}, {"count", required_argument, 0, O_COUNT},
        {"tier", required_argument, 0, O_TIER},       {"limit", required_argument, 0, O_LIMIT},
        {"tokens", required_argument, 0, O_TOKENS},   {"no-progress", no_argument, 0, O_NOPROG},
        {0, 0, 0, 0}};
    int ch;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, "hj", lopts, NULL)) != -1) {
        unsigned long v;
        char *end;
        switch (ch) {
        case O_SOCKET: o.socket = optarg; break;
        case O_TARGET: o.target = optarg; break;
        case O_NS: o.ns = optarg; break;
        case O_TIMEOUT:
            if (parse_ulong(optarg, 3600000, &v) != 0 || v == 0) {
                fprintf(stderr, "tierkv: --timeout wants milliseconds 1..3600000, got '%s'\n",
                        optarg);
                return EXIT_USAGE;
            }
            o.timeout_ms = v;
            break;
        case 'j': o.json = 1; break;
        case 'h': help = 1; break;
        case O_INTERVAL:
            o.interval_s = strtod(optarg, &end);
            if (end == optarg || *end || !(o.interval_s >= 0.05 && o.interval_s <= 3600)) {
                fprintf(stderr, "tierkv: --interval wants seconds 0.05..3600, got '%s'\n", optarg);
                return EXIT_USAGE;
            }
            break;
        case O_COUNT:
            if (parse_ulong(optarg, 1000000000, &v) != 0) {
                fprintf(stderr, "tierkv: --count wants a number, got '%s'\n", optarg);
                return EXIT_USAGE;
            }
            o.count = (long)v;
            break;
        case O_TIER:
            if (parse_tier(optarg, &o.tier) != 0) {
                fprintf(stderr, "tierkv: --tier wants all, l1, l2 or l3, got '%s'\n", optarg);
                return EXIT_USAGE;
            }
            o.tier_given = 1;
            break;
        case O_LIMIT:
            if (parse_ulong(optarg, UINT32_MAX, &v) != 0) {
                fprintf(stderr, "tierkv: --limit wants a number, got '%s'\n", optarg);
                return EXIT_USAGE;
            }
            o.limit = v;
            break;
        case O_TOKENS: o.tokens_path = optarg; break;
        case O_NOPROG: o.no_progress = 1; break;
        default:
            fprintf(stderr, "tierkv: unknown or incomplete option '%s' (see tierkv --help)\n",
                    argv[optind - 1]);
            return EXIT_USAGE;
        }
    }
    const char *name = optind < argc ? argv[optind] : NULL;
    if (!name) {
        usage(help ? stdout : stderr);
        return help ? EXIT_OK : EXIT_USAGE;
    }
    const command *cmd = NULL;
    for (size_t i = 0; i < sizeof(kCommands) / sizeof(kCommands[0]); i++)
        if (strcmp(kCommands[i].name, name) == 0)
            cmd = &kCommands[i];
    if (!cmd) {
        fprintf(stderr, "tierkv: unknown command '%s' (see tierkv --help)\n", name);
        return EXIT_USAGE;
    }
    if (help) {
        command_help(name, stdout);
        return EXIT_OK;
    }
    int nargs = argc - optind - 1;
    if (nargs > (strcmp(name, "lookup") == 0 ? 1 : 0)) {
        fprintf(stderr, "tierkv %s: unexpected argument '%s'\n", name, argv[optind + 1]);
        return EXIT_USAGE;
    }
    if (nargs == 1)
        o.file = argv[optind + 1];

    kvc_opts *ko = kvc_opts_new();
    int rc = KVC_OK;
    if (o.target)
        rc = kvc_opts_set_target(ko, o.target);
    else if (o.socket)
        rc = kvc_opts_set_socket(ko, o.socket);
    if (rc == KVC_OK && o.ns)
        rc = kvc_opts_set_namespace(ko, o.ns);
    if (rc == KVC_OK)
        rc = kvc_opts_set_timeout_ms(ko, (uint32_t)o.timeout_ms);
    if (rc != KVC_OK) {
        fprintf(stderr, "tierkv: %s\n", kvc_last_error());
        kvc_opts_free(ko);
        return EXIT_USAGE;
    }
    kvc_client *c = NULL;
    rc = kvc_connect(ko, &c);
    kvc_opts_free(ko);
    if (rc != KVC_OK)
        return report(rc);
    int ex = cmd->fn(c, &o);
    kvc_close(c);
    return ex;
}

/* storage_bench.c - L3 write/read throughput against fio on the same file system, prefix
 * lookup latency and rate, and key-derivation throughput. A benchmark, never a test.
 *
 *   storage_bench [--dir DIR] [--blocks N] [--qd N] [--batch N] [--threads N] [--reps N]
 *                 [--zstd-level N] [--io auto|uring|psync] [--no-fio] [--json]
 *
 * Block = 64 tokens of a 32-layer, 8-KV-head, head-dim-128 FP8 model: 4 MiB. Payloads are
 * FP8 e4m3 encodings of normally distributed values (what a KV cache holds), so they are
 * realistic for compression too; by default they are stored raw (zstd level 0), so the
 * figures measure the I/O path, not the compressor. The ceiling is fio (io_uring, O_DIRECT,
 * the same block size and queue depth, and for writes an fdatasync per queue-depth batch,
 * as the store syncs each group of queue-depth writes), run by this program on the same
 * directory. The L3 side is driven like the tier manager drives it: --threads callers
 * (default 2) of --batch blocks per call (default 32), the queue depth split among them, so
 * the total in flight equals fio's. Each figure is the median of --reps runs.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <ftw.h>

#include "tkv_base.h"
#include "tkv_keys.h"
#include "tkv_l3.h"
#include "tkv_store.h"

#define MAX_REPS 15

typedef struct cfg {
    const char *dir;
    int own_dir;
    size_t num_blocks;
    unsigned qd;
    size_t batch;   /* blocks per put_batch / get_batch call */
    int threads;    /* L3 callers; the queue depth is split among them */
    int reps;
    int zstd_level;
    int io_mode;
    int fio;
    int json;
} cfg;

static void die(const char *what, int rc)
{
    fprintf(stderr, "storage_bench: %s: %s\n", what, tkv_strerror(rc));
    exit(1);
}

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

static void rm_tree(const char *p) { nftw(p, rm_one, 16, FTW_DEPTH | FTW_PHYS); }

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- payloads: FP8 e4m3 KV bytes --------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = (*s += 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Saturating, round-to-nearest float -> e4m3 (bias 7, 3 mantissa bits, max 448). */
static uint8_t to_e4m3(float f)
{
    uint8_t sign = f < 0 ? 0x80 : 0;
    float a = fabsf(f);
    if (a >= 448.0f)
        return sign | 0x7e;
    if (a < 0.0009765625f) /* below half the smallest subnormal (2^-9) */
        return sign;
    int e;
    float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    int exp = e - 1 + 7;     /* biased exponent of 1.xxx form */
    if (exp <= 0) {          /* subnormal: value = mant/8 * 2^-6 */
        int mant = (int)lrintf(a * 512.0f);
        return sign | (uint8_t)(mant > 7 ? 8 : mant);
    }
    int mant = (int)lrintf((m * 2.0f - 1.0f) * 8.0f);
    if (mant == 8) {
        mant = 0;
        exp++;
    }
    if (exp > 15 || (exp == 15 && mant > 6))
        return sign | 0x7e;
    return sign | (uint8_t)(exp << 3) | (uint8_t)mant;
}

static void fill_kv(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t s = seed * 7919 + 1;
    for (size_t i = 0; i < n; i += 4) {
        uint64_t r = rng_next(&s);
        for (int k = 0; k < 4 && i + (size_t)k < n; k++) {
            /* Irwin-Hall(4) ~ normal; KV activations of a few units */
            uint16_t u = (uint16_t)(r >> (16 * k));
            float x = ((float)(u & 0xff) + (float)(u >> 8) + (float)((r >> 40) & 0xff) +
                       (float)((r >> 3) & 0xff)) / 255.0f - 2.0f;
            p[i + (size_t)k] = to_e4m3(x * 3.0f);
        }
    }
}

/* ---- L3 throughput ------------------------------------------------------------------------ */

typedef struct l3_result {
    double write_gbps, read_gbps;
    int io_mode;
    uint64_t stored_bytes, raw_bytes;
} l3_result;

/* One caller thread of the L3 phase: calls k = t, t + T, t + 2T, ... of per_call blocks. */
typedef struct l3_worker {
    tkv_l3 *l3;
    const cfg *c;
    int t;
    size_t block_bytes;
    uint8_t **payloads;
    int num_payloads;
    int write;
    uint8_t **dst;          /* per_call aligned buffers (reads) */
    int failed;
} l3_worker;

static void *l3_worker_main(void *p)
{
    l3_worker *w = p;
    const cfg *c = w->c;
    size_t n = c->num_blocks, per_call = c->batch;
    tkv_l3_put_req *pr = calloc(per_call, sizeof(*pr));
    tkv_l3_get_req *gr = calloc(per_call, sizeof(*gr));
    uint32_t tokens[64];
    for (int t = 0; t < 64; t++)
        tokens[t] = (uint32_t)t;
    for (size_t i = (size_t)w->t * per_call; i < n; i += (size_t)c->threads * per_call) {
        size_t m = n - i < per_call ? n - i : per_call;
        int rc;
        for (size_t k = 0; k < m; k++) {
            uint64_t id = i + k;
            if (w->write) {
                memset(&pr[k], 0, sizeof(pr[k]));
                memcpy(pr[k].key.b, &id, sizeof(id));
                pr[k].payload = w->payloads[id % (size_t)w->num_payloads];
                pr[k].len = w->block_bytes;
                pr[k].tokens = tokens;
                pr[k].num_tokens = 64;
            } else {
                memset(&gr[k], 0, sizeof(gr[k]));
                memcpy(gr[k].key.b, &id, sizeof(id));
                gr[k].dst = w->dst[k];
                gr[k].cap = w->block_bytes;
            }
        }
        rc = w->write ? tkv_l3_put_batch(w->l3, pr, m) : tkv_l3_get_batch(w->l3, gr, m);
        if (rc != TKV_OK) {
            fprintf(stderr, "storage_bench: l3 %s: %s\n", w->write ? "put" : "get",
                    tkv_strerror(rc));
            w->failed = 1;
            break;
        }
        /* a read batch must be the bytes written (cheap next to the I/O it follows) */
        for (size_t k = 0; !w->write && k < m; k++)
            if (memcmp(w->dst[k], w->payloads[(i + k) % (size_t)w->num_payloads],
                       w->block_bytes) != 0) {
                fprintf(stderr, "storage_bench: block %zu read back wrong\n", i + k);
                w->failed = 1;
            }
    }
    free(pr);
    free(gr);
    return NULL;
}

/* Writes then reads num_blocks blocks with `threads` callers; the queue depth is split among
 * them (each caller's I/O context gets qd / threads), so the total in flight is fio's. */
static void l3_run(const cfg *c, size_t block_bytes, uint8_t **payloads, int num_payloads,
                   const uint8_t fp[TKV_KEY_BYTES], l3_result *res)
{
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s/l3", c->dir);
    rm_tree(dir);
    tkv_l3_opts *o = tkv_l3_opts_new();
    tkv_l3_opts_set_fingerprint(o, fp);
    tkv_l3_opts_set_max_block_bytes(o, block_bytes);
    tkv_l3_opts_set_zstd_level(o, c->zstd_level);
    tkv_l3_opts_set_io_mode(o, c->io_mode);
    tkv_l3_opts_set_queue_depth(o, c->qd / (unsigned)c->threads);
    tkv_l3 *l3 = NULL;
    int rc = tkv_l3_open(dir, o, &l3);
    tkv_l3_opts_free(o);
    if (rc != TKV_OK)
        die("l3 open", rc);

    l3_worker w[8];
    pthread_t tid[8];
    for (int phase = 1; phase >= 0; phase--) { /* write, then read */
        for (int t = 0; t < c->threads; t++) {
            w[t] = (l3_worker){.l3 = l3, .c = c, .t = t, .block_bytes = block_bytes,
                               .payloads = payloads, .num_payloads = num_payloads,
                               .write = phase};
            if (!phase) {
                w[t].dst = calloc(c->batch, sizeof(*w[t].dst));
                for (size_t k = 0; k < c->batch; k++) {
                    if (posix_memalign((void **)&w[t].dst[k], 4096, block_bytes) != 0)
                        die("memory", TKV_ENOMEM);
                    memset(w[t].dst[k], 0, block_bytes); /* fault in outside the timing */
                }
            }
        }
        uint64_t t0 = tkv_now_ns();
        for (int t = 0; t < c->threads; t++)
            pthread_create(&tid[t], NULL, l3_worker_main, &w[t]);
        for (int t = 0; t < c->threads; t++)
            pthread_join(tid[t], NULL);
        double gbps = (double)c->num_blocks * (double)block_bytes / (double)(tkv_now_ns() - t0);
        for (int t = 0; t < c->threads; t++) {
            if (w[t].failed)
                exit(1);
            if (w[t].dst) {
                for (size_t k = 0; k < c->batch; k++)
                    free(w[t].dst[k]);
                free(w[t].dst);
            }
        }
        if (phase)
            res->write_gbps = gbps;
        else
            res->read_gbps = gbps;
    }

    tkv_l3_stats st;
    tkv_l3_get_stats(l3, &st);
    res->io_mode = st.io_mode;
    res->stored_bytes = st.stored_bytes;
    res->raw_bytes = st.raw_bytes;
    tkv_l3_close(l3);
    rm_tree(dir);
}

/* ---- fio ceiling -------------------------------------------------------------------------- */

/* Runs fio and returns bytes/s of the given direction, or -1. */
static double fio_run(const cfg *c, size_t block_bytes, int write)
{
    /* writes: one fdatasync per queue-depth batch, as the store syncs each batch */
    char sync[64] = "";
    if (write)
        snprintf(sync, sizeof(sync), "--fdatasync=%u", c->qd);
    char cmd[8192];
    snprintf(cmd, sizeof(cmd),
             "fio --name=ceiling --filename=%s/fio.dat --size=%zu --bs=%zu --iodepth=%u "
             "--ioengine=io_uring --direct=1 --rw=%s %s --output-format=json 2>/dev/null",
             c->dir, c->num_blocks * block_bytes, block_bytes, c->qd, write ? "write" : "read",
             sync);
    FILE *f = popen(cmd, "r");
    if (!f)
        return -1;
    size_t cap = 1 << 16, len = 0;
    char *out = malloc(cap);
    size_t r;
    while ((r = fread(out + len, 1, cap - len - 1, f)) > 0) {
        len += r;
        if (len + 1 == cap) {
            cap *= 2;
            out = realloc(out, cap);
        }
    }
    out[len] = 0;
    int st = pclose(f);
    double bw = -1;
    const char *dir = strstr(out, write ? "\"write\" : {" : "\"read\" : {");
    const char *bwp = dir ? strstr(dir, "\"bw_bytes\" : ") : NULL;
    if (st == 0 && bwp)
        bw = strtod(bwp + strlen("\"bw_bytes\" : "), NULL);
    free(out);
    return bw;
}

/* ---- lookups and hashing ------------------------------------------------------------------ */

typedef struct lookup_thread {
    tkv_store *s;
    const tkv_key *keys;
    size_t num_keys;
    uint64_t owner;
    double seconds;
    uint64_t count;
} lookup_thread;

static void *lookup_main(void *p)
{
    lookup_thread *a = p;
    uint64_t t0 = tkv_now_ns(), end = t0 + (uint64_t)(a->seconds * 1e9);
    while (tkv_now_ns() < end) {
        for (int k = 0; k < 64; k++) {
            uint64_t lease = 0;
            size_t hit = 0;
            if (tkv_store_lookup(a->s, a->keys, a->num_keys, a->owner, 0, &lease, &hit, NULL) !=
                TKV_OK || hit != a->num_keys)
                die("lookup", TKV_ENOTFOUND);
            tkv_store_lease_release(a->s, lease);
            a->count++;
        }
    }
    return NULL;
}

typedef struct lookup_result {
    double p50_us, p99_us, per_s;
    size_t chain;
} lookup_result;

static void lookup_bench(const uint8_t fp[TKV_KEY_BYTES], lookup_result *res)
{
    enum { CHAIN = 256, SAMPLES = 20000, SMALL = 4096 };
    /* The lookup touches only the index: a small block keeps the L2 pool small. */
    tkv_store_opts *o = tkv_store_opts_new();
    tkv_store_opts_set_block(o, SMALL, 64);
    tkv_store_opts_set_fingerprint(o, fp);
    tkv_store_opts_set_l2_blocks(o, CHAIN * 2);
    tkv_store_opts_set_l3(o, NULL, 0);
    tkv_store *s = NULL;
    int rc = tkv_store_open(o, &s);
    tkv_store_opts_free(o);
    if (rc != TKV_OK)
        die("store open", rc);
    uint32_t *tokens = malloc(sizeof(uint32_t) * CHAIN * 64);
    for (size_t i = 0; i < CHAIN * 64; i++)
        tokens[i] = (uint32_t)(i * 2654435761u % 151936);
    tkv_key root, *keys = malloc(sizeof(tkv_key) * CHAIN);
    tkv_key_root(fp, "bench", 5, &root);
    if (tkv_key_chain(&root, tokens, CHAIN * 64, 64, keys, CHAIN) != CHAIN)
        die("key chain", TKV_EINVAL);
    uint8_t *blk = calloc(CHAIN, SMALL);
    const void **payloads = malloc(sizeof(void *) * CHAIN);
    for (size_t i = 0; i < CHAIN; i++)
        payloads[i] = blk + i * SMALL;
    size_t stored = 0;
    rc = tkv_store_put(s, NULL, keys, tokens, payloads, CHAIN, &stored);
    if (rc != TKV_OK || stored != CHAIN)
        die("store put", rc != TKV_OK ? rc : TKV_EFULL);

    double *lat = malloc(sizeof(double) * SAMPLES);
    for (int i = 0; i < SAMPLES; i++) {
        uint64_t lease = 0;
        size_t hit = 0;
        uint64_t t0 = tkv_now_ns();
        rc = tkv_store_lookup(s, keys, CHAIN, 1, 0, &lease, &hit, NULL);
        uint64_t t1 = tkv_now_ns();
        if (rc != TKV_OK || hit != CHAIN)
            die("lookup", rc != TKV_OK ? rc : TKV_ENOTFOUND);
        tkv_store_lease_release(s, lease);
        lat[i] = (double)(t1 - t0) / 1e3;
    }
    qsort(lat, SAMPLES, sizeof(*lat), cmp_double);
    res->p50_us = lat[SAMPLES / 2];
    res->p99_us = lat[SAMPLES * 99 / 100];
    res->chain = CHAIN;

    lookup_thread th[2];
    pthread_t tid[2];
    uint64_t t0 = tkv_now_ns();
    for (int t = 0; t < 2; t++) {
        th[t] = (lookup_thread){.s = s, .keys = keys, .num_keys = CHAIN,
                                .owner = (uint64_t)t + 10, .seconds = 1.0};
        pthread_create(&tid[t], NULL, lookup_main, &th[t]);
    }
    for (int t = 0; t < 2; t++)
        pthread_join(tid[t], NULL);
    double secs = (double)(tkv_now_ns() - t0) / 1e9;
    res->per_s = (double)(th[0].count + th[1].count) / secs;

    tkv_store_close(s);
    free(lat);
    free(payloads);
    free(blk);
    free(keys);
    free(tokens);
}

static double hash_bench(const uint8_t fp[TKV_KEY_BYTES])
{
    enum { TOKENS = 64 * 4096 };
    uint32_t *tokens = malloc(sizeof(uint32_t) * TOKENS);
    for (size_t i = 0; i < TOKENS; i++)
        tokens[i] = (uint32_t)(i * 2246822519u % 151936);
    tkv_key root, *keys = malloc(sizeof(tkv_key) * (TOKENS / 64));
    tkv_key_root(fp, "", 0, &root);
    uint64_t total = 0, t0 = tkv_now_ns(), t1;
    do {
        if (tkv_key_chain(&root, tokens, TOKENS, 64, keys, TOKENS / 64) != TOKENS / 64)
            die("key chain", TKV_EINVAL);
        total += TOKENS;
        t1 = tkv_now_ns();
    } while (t1 - t0 < 500000000ull);
    free(tokens);
    free(keys);
    return (double)total / ((double)(t1 - t0) / 1e9);
}

/* ---- machine ------------------------------------------------------------------------------ */

static void describe(const char *dir, char *out, size_t n)
{
    char cpu[256] = "unknown CPU";
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (f && fgets(line, sizeof(line), f)) {
        if (strncmp(line, "model name", 10) == 0) {
            char *p = strchr(line, ':');
            if (p) {
                snprintf(cpu, sizeof(cpu), "%s", p + 2);
                cpu[strcspn(cpu, "\n")] = 0;
            }
            break;
        }
    }
    if (f)
        fclose(f);
    /* the file system holding dir: the longest mount point that prefixes it */
    char fs[512] = "?", dev[512] = "?", best[1024] = "";
    char real[4096];
    if (!realpath(dir, real))
        snprintf(real, sizeof(real), "%s", dir);
    f = fopen("/proc/mounts", "r");
    while (f && fgets(line, sizeof(line), f)) {
        char d[512], mp[1024], t[512];
        if (sscanf(line, "%511s %1023s %511s", d, mp, t) != 3)
            continue;
        size_t l = strlen(mp);
        if (strncmp(real, mp, l) == 0 && (real[l] == '/' || real[l] == 0 || l == 1) &&
            l >= strlen(best)) {
            snprintf(best, sizeof(best), "%s", mp);
            snprintf(fs, sizeof(fs), "%s", t);
            snprintf(dev, sizeof(dev), "%s", d);
        }
    }
    if (f)
        fclose(f);
    struct utsname u;
    uname(&u);
    snprintf(out, n, "%s, %ld cores, Linux %s, %s on %s (%s)", cpu, sysconf(_SC_NPROCESSORS_ONLN),
             u.release, fs, dev, best);
}

/* ---- main --------------------------------------------------------------------------------- */

static void usage(void)
{
    fprintf(stderr, "usage: storage_bench [--dir DIR] [--blocks N] [--qd N] [--batch N] "
                    "[--threads N] [--reps N] "
                    "[--zstd-level N] [--io auto|uring|psync] [--no-fio] [--json]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    cfg c = {.num_blocks = 256, .qd = 32, .batch = 32, .threads = 2, .reps = 3, .zstd_level = 0,
             .io_mode = TKV_IO_AUTO,
             .fio = 1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--json") == 0) {
            c.json = 1;
        } else if (strcmp(a, "--no-fio") == 0) {
            c.fio = 0;
        } else if (v && strcmp(a, "--dir") == 0) {
            c.dir = v;
            i++;
        } else if (v && strcmp(a, "--blocks") == 0) {
            c.num_blocks = strtoul(v, NULL, 10);
            i++;
        } else if (v && strcmp(a, "--qd") == 0) {
            c.qd = (unsigned)strtoul(v, NULL, 10);
            i++;
        } else if (v && strcmp(a, "--batch") == 0) {
            c.batch = strtoul(v, NULL, 10);
            i++;
        } else if (v && strcmp(a, "--threads") == 0) {
            c.threads = atoi(v);
            i++;
        } else if (v && strcmp(a, "--reps") == 0) {
            c.reps = atoi(v);
            i++;
        } else if (v && strcmp(a, "--zstd-level") == 0) {
            c.zstd_level = atoi(v);
            i++;
        } else if (v && strcmp(a, "--io") == 0) {
            c.io_mode = strcmp(v, "uring") == 0 ? TKV_IO_URING
                        : strcmp(v, "psync") == 0 ? TKV_IO_PSYNC
                        : strcmp(v, "auto") == 0 ? TKV_IO_AUTO : -1;
            if (c.io_mode < 0)
                usage();
            i++;
        } else {
            usage();
        }
    }
    if (c.num_blocks < 1 || c.qd < 1 || c.qd > 1024 || c.batch < 1 || c.batch > 4096 ||
        c.reps < 1 || c.reps > MAX_REPS || c.threads < 1 || c.threads > 8 ||
        c.qd % (unsigned)c.threads != 0 ||
        c.zstd_level < 0 || c.zstd_level > 19)
        usage();
    char tmpl[4096];
    if (!c.dir) {
        const char *base = getenv("TMPDIR");
        snprintf(tmpl, sizeof(tmpl), "%s/tierkv-bench-XXXXXX", base && *base ? base : "/tmp");
        if (!mkdtemp(tmpl)) {
            perror("mkdtemp");
            return 1;
        }
        c.dir = tmpl;
        c.own_dir = 1;
    } else if (mkdir(c.dir, 0755) != 0 && errno != EEXIST) {
        perror(c.dir);
        return 1;
    }

    tkv_geometry g = {.num_layers = 32, .num_kv_heads = 8, .head_dim = 128, .block_tokens = 64,
                      .dtype = TKV_DTYPE_FP8_E4M3, .scale_mode = TKV_SCALE_PER_TENSOR};
    snprintf(g.model_id, sizeof(g.model_id), "bench/32L-8kv-128d-fp8");
    size_t block_bytes = tkv_geometry_block_bytes(&g);
    if (block_bytes == 0)
        die("geometry", TKV_EINVAL);
    uint8_t fp[TKV_KEY_BYTES];
    tkv_geometry_fingerprint(&g, fp);

    enum { NUM_PAYLOADS = 8 };
    uint8_t *payloads[NUM_PAYLOADS];
    for (int i = 0; i < NUM_PAYLOADS; i++) {
        if (posix_memalign((void **)&payloads[i], 4096, block_bytes) != 0)
            die("memory", TKV_ENOMEM);
        fill_kv(payloads[i], block_bytes, (uint64_t)i);
    }

    double lw[MAX_REPS], lr[MAX_REPS], fw[MAX_REPS], fr[MAX_REPS];
    l3_result l3r = {0};
    for (int r = 0; r < c.reps; r++) {
        /* alternate which goes first, so a drift of the disk does not favour one side */
        for (int half = 0; half < 2; half++) {
            if ((half == 0) == (r % 2 == 0)) {
                l3_run(&c, block_bytes, payloads, NUM_PAYLOADS, fp, &l3r);
                lw[r] = l3r.write_gbps;
                lr[r] = l3r.read_gbps;
            } else if (c.fio) {
                fw[r] = fio_run(&c, block_bytes, 1) / 1e9;
                fr[r] = fio_run(&c, block_bytes, 0) / 1e9;
                char p[4200];
                snprintf(p, sizeof(p), "%s/fio.dat", c.dir);
                unlink(p);
            }
        }
        if (!c.json)
            fprintf(stderr, "rep %d: l3 write %.3f read %.3f GB/s; fio write %.3f read %.3f GB/s\n",
                    r + 1, lw[r], lr[r], c.fio ? fw[r] : 0.0, c.fio ? fr[r] : 0.0);
    }
    double l3w = median(lw, c.reps), l3rd = median(lr, c.reps);
    double fiow = c.fio ? median(fw, c.reps) : -1, fior = c.fio ? median(fr, c.reps) : -1;
    int fio_ok = c.fio && fiow > 0 && fior > 0;

    lookup_result lk;
    lookup_bench(fp, &lk);
    double hash_tps = hash_bench(fp);
    char machine[2048];
    describe(c.dir, machine, sizeof(machine));
    double ratio_w = fio_ok ? l3w / fiow : -1, ratio_r = fio_ok ? l3rd / fior : -1;
    const char *io = l3r.io_mode == TKV_IO_URING ? "io_uring" : "pread/pwrite";

    if (c.json) {
        printf("{\"machine\":\"%s\",\"dir\":\"%s\",\"block_bytes\":%zu,\"blocks\":%zu,"
               "\"queue_depth\":%u,\"batch\":%zu,\"threads\":%d,\"reps\":%d,"
               "\"zstd_level\":%d,\"l3_io\":\"%s\","
               "\"stored_over_raw\":%.4f,"
               "\"l3_write_gbps\":%.4f,\"l3_read_gbps\":%.4f,",
               machine, c.dir, block_bytes, c.num_blocks, c.qd, c.batch, c.threads, c.reps,
               c.zstd_level, io,
               l3r.raw_bytes ? (double)l3r.stored_bytes / (double)l3r.raw_bytes : 0.0, l3w,
               l3rd);
        if (fio_ok)
            printf("\"fio_write_gbps\":%.4f,\"fio_read_gbps\":%.4f,\"l3_write_ratio_fio\":%.4f,"
                   "\"l3_read_ratio_fio\":%.4f,",
                   fiow, fior, ratio_w, ratio_r);
        else
            printf("\"fio_write_gbps\":null,\"fio_read_gbps\":null,\"l3_write_ratio_fio\":null,"
                   "\"l3_read_ratio_fio\":null,");
        printf("\"lookup_chain_blocks\":%zu,\"lookup_p50_us\":%.3f,\"lookup_p99_us\":%.3f,"
               "\"lookups_per_s\":%.1f,\"hash_tokens_per_s\":%.1f}\n",
               lk.chain, lk.p50_us, lk.p99_us, lk.per_s, hash_tps);
    } else {
        printf("storage_bench: %s\n", machine);
        printf("block %zu bytes (64 tokens, 32 layers, 8 KV heads, dim 128, FP8), %zu blocks, "
               "QD %u (L3: %d callers x QD %u, %zu blocks per call), median of %d, zstd level %d "
               "(stored/raw %.3f), L3 via %s\n",
               block_bytes, c.num_blocks, c.qd, c.threads, c.qd / (unsigned)c.threads, c.batch,
               c.reps, c.zstd_level,
               l3r.raw_bytes ? (double)l3r.stored_bytes / (double)l3r.raw_bytes : 0.0, io);
        printf("%-28s %12s %12s %10s\n", "metric", "tierkv L3", "fio", "L3/fio");
        if (fio_ok) {
            printf("%-28s %12.3f %12.3f %10.3f\n", "write GB/s", l3w, fiow, ratio_w);
            printf("%-28s %12.3f %12.3f %10.3f\n", "read GB/s", l3rd, fior, ratio_r);
        } else {
            printf("%-28s %12.3f %12s %10s\n", "write GB/s", l3w, "-", "-");
            printf("%-28s %12.3f %12s %10s\n", "read GB/s", l3rd, "-", "-");
        }
        printf("%-28s %12.2f\n", "lookup 256 blocks p50 us", lk.p50_us);
        printf("%-28s %12.2f\n", "lookup 256 blocks p99 us", lk.p99_us);
        printf("%-28s %12.0f\n", "lookups/s (2 threads)", lk.per_s);
        printf("%-28s %12.0f\n", "key derivation tokens/s", hash_tps);
    }
    for (int i = 0; i < NUM_PAYLOADS; i++)
        free(payloads[i]);
    if (c.own_dir)
        rm_tree(c.dir);
    return 0;
}

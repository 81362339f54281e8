/* config.c - tierkvd's configuration: key table, parser, validation (see tkvd_config.h). */
#include "tkvd_config.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>
#include <unistd.h>

#include "tkv_base.h"
#include "tkv_l3.h"
#include "tkv_l4.h"
#include "tkv_policy.h"
#include "tkv_rcluster.h"

/* ---- the key table ------------------------------------------------------------------------
 * One row per key: how to parse it, where it goes, its range and its help line. The table is
 * the single source for the parser, --help, --print-config and the flag names. */

typedef enum { K_U32, K_U64, K_SIZE, K_BOOL, K_STR, K_INT, K_ENUM } key_type;

typedef struct key_def {
    const char *name;
    key_type type;
    size_t offset;
    int64_t min;             /* K_U32/K_U64/K_SIZE/K_INT range (inclusive) */
    uint64_t max;
    const char *const *enum_names; /* K_ENUM: NULL-terminated, value = index */
    const char *help;
} key_def;

#define OFF(field) offsetof(tkvd_config, field)
#define GEO(field) (offsetof(tkvd_config, geometry) + offsetof(tkv_geometry, field))

static const char *const dtype_names[] = {"fp8_e4m3", "bf16", NULL};
static const char *const scale_names[] = {"per_tensor", "per_token_head", NULL};
static const char *const io_names[] = {"auto", "uring", "psync", NULL};
static const char *const level_names[] = {"error", "warn", "info", "debug", NULL};

static const key_def kKeys[] = {
    /* geometry */
    {"model_id", K_STR, GEO(model_id), 1, TKV_MODEL_ID_MAX - 1, NULL,
     "model identifier, part of the fingerprint (default tierkv-demo)"},
    {"num_layers", K_U32, GEO(num_layers), 1, 1024, NULL, "layers (default 4)"},
    {"num_kv_heads", K_U32, GEO(num_kv_heads), 1, 256, NULL, "KV heads (default 2)"},
    {"head_dim", K_U32, GEO(head_dim), 64, 256, NULL, "head dimension: 64, 128, 256 (default 64)"},
    {"block_tokens", K_U32, GEO(block_tokens), 16, 128, NULL,
     "tokens per block: 16, 32, 64, 128 (default 64)"},
    {"kv_dtype", K_ENUM, GEO(dtype), 0, 0, dtype_names, "fp8_e4m3 (default) or bf16"},
    {"scale_mode", K_ENUM, GEO(scale_mode), 0, 0, scale_names,
     "per_tensor (default) or per_token_head (fp8 only)"},
    /* tiers */
    {"l2_bytes", K_SIZE, OFF(l2_bytes), 1, UINT64_C(1) << 44, NULL,
     "host-memory pool size, K/M/G suffixes (default 256M)"},
    {"l2_blocks", K_U64, OFF(l2_blocks), 0, UINT64_C(1) << 32, NULL,
     "host-memory pool in blocks; 0 = from l2_bytes (default 0)"},
    {"l1_bytes", K_SIZE, OFF(l1_bytes), 0, UINT64_C(1) << 44, NULL,
     "GPU pool (L1) size in HBM, 0 = off; used only where a GPU is present (default 1G)"},
    {"l3_read_mbps", K_U32, OFF(l3_read_mbps), 1, 1000000, NULL,
     "local-store read rate the cost check assumes, MB/s (default 2000)"},
    {"gpu_device", K_INT, OFF(gpu_device), 0, 63, NULL, "CUDA device of the L1 pool (default 0)"},
    {"l3", K_BOOL, OFF(l3_enabled), 0, 1, NULL, "local store on/off (default on)"},
    {"l3_dir", K_STR, OFF(l3_dir), 0, PATH_MAX - 1, NULL, "local store folder (default <data_dir>/l3)"},
    {"l3_capacity_bytes", K_SIZE, OFF(l3_capacity_bytes), 0, UINT64_MAX, NULL,
     "local store capacity, 0 = unlimited (default 0)"},
    {"zstd_level", K_INT, OFF(zstd_level), 0, 19, NULL, "L3 compression level, 0 = raw (default 1)"},
    {"io_mode", K_ENUM, OFF(io_mode), 0, 0, io_names,
     "L3 I/O: auto (io_uring, else pread/pwrite), uring, psync (default auto)"},
    {"write_through", K_BOOL, OFF(write_through), 0, 1, NULL,
     "write every stored block down to L3 (default on)"},
    {"policy", K_STR, OFF(policy), 1, 63, NULL,
     "eviction policy: hazard or lru (default hazard)"},
    {"store_workers", K_U32, OFF(store_workers), 1, 64, NULL, "store worker threads (default 4)"},
    {"lease_ttl_ms", K_U32, OFF(lease_ttl_ms), 1, 86400000, NULL,
     "default lease time-to-live (default 30000)"},
    {"lease_ttl_max_ms", K_U32, OFF(lease_ttl_max_ms), 1, 86400000, NULL,
     "longest lease a client may ask for (default 600000)"},
    /* the shared tier (L4) on Redis Cluster */
    {"l4_redis_nodes", K_STR, OFF(l4_redis_nodes), 0, 4095, NULL,
     "Redis Cluster seed nodes host:port[,host:port...]; empty = L4 off (default empty)"},
    {"l4_bytes_budget", K_SIZE, OFF(l4_bytes_budget), 0, UINT64_C(1) << 40, NULL,
     "bytes of write-down to L4 queued at most; beyond, blocks are not written; 0 = read-only "
     "L4 (default 256M)"},
    {"l4_connect_timeout_ms", K_U32, OFF(l4_connect_timeout_ms), 1, 60000, NULL,
     "L4: TCP connect + AUTH deadline per node (default 500)"},
    {"l4_timeout_ms", K_U32, OFF(l4_timeout_ms), 1, 600000, NULL,
     "L4: deadline of one pipelined round to the cluster (default 2000)"},
    {"l4_ttl_s", K_U32, OFF(l4_ttl_s), 0, 365u * 86400u, NULL,
     "L4: expiry of each value written, 0 = none (Redis's maxmemory policy evicts) (default 0)"},
    {"l4_connections", K_U32, OFF(l4_connections), 1, 64, NULL,
     "L4: router connections for lookups (each reaches every node) (default 4)"},
    {"l4_redis_user", K_STR, OFF(l4_redis_user), 0, 255, NULL,
     "L4: ACL user for AUTH (needs l4_redis_password); empty = the default user"},
    {"l4_redis_password", K_STR, OFF(l4_redis_password), 0, 1023, NULL,
     "L4: AUTH password; empty = no AUTH (never printed by --print-config)"},
    /* paths */
    {"data_dir", K_STR, OFF(data_dir), 1, PATH_MAX - 1, NULL, "data folder (default ./tierkv-data)"},
    {"run_dir", K_STR, OFF(run_dir), 1, PATH_MAX - 1, NULL,
     "sockets and pid file (default /run/tierkv as root, else $XDG_RUNTIME_DIR/tierkv or "
     "/tmp/tierkv-<uid>)"},
    {"pid_file", K_STR, OFF(pid_file), 0, PATH_MAX - 1, NULL, "pid file (default <run_dir>/tierkvd.pid)"},
    {"log_file", K_STR, OFF(log_file), 0, PATH_MAX - 1, NULL,
     "log file; empty = stderr in the foreground, <data_dir>/tierkvd.log otherwise"},
    /* sockets */
    {"grpc_socket", K_STR, OFF(grpc_socket), 0, 107, NULL,
     "gRPC UNIX socket (default <run_dir>/tierkv.sock)"},
    {"grpc_tcp", K_STR, OFF(grpc_tcp), 0, 255, NULL, "also serve gRPC on host:port (default off)"},
    {"tls_cert", K_STR, OFF(tls_cert), 0, PATH_MAX - 1, NULL, "PEM certificate chain for grpc_tcp"},
    {"tls_key", K_STR, OFF(tls_key), 0, PATH_MAX - 1, NULL, "PEM private key for grpc_tcp"},
    {"tls_client_ca", K_STR, OFF(tls_client_ca), 0, PATH_MAX - 1, NULL,
     "PEM CA bundle: TCP clients must present a certificate it signed (default: none asked)"},
    {"attach_socket", K_STR, OFF(attach_socket), 0, 107, NULL,
     "shared-memory attach socket (default <run_dir>/attach.sock)"},
    {"attach_writable", K_BOOL, OFF(attach_writable), 0, 1, NULL,
     "let engines of the daemon's own user (or root) map the L2 pool writable (default on)"},
    {"http", K_BOOL, OFF(http_enabled), 0, 1, NULL, "serve /metrics and the dashboard (default on)"},
    {"http_address", K_STR, OFF(http_address), 1, 255, NULL, "HTTP bind address (default 127.0.0.1)"},
    {"http_port", K_U32, OFF(http_port), 0, 65535, NULL, "HTTP port, 0 = pick one (default 9464)"},
    /* server */
    {"cq_threads", K_U32, OFF(cq_threads), 1, 64, NULL, "gRPC completion-queue threads (default 2)"},
    {"rpc_workers", K_U32, OFF(rpc_workers), 1, 256, NULL,
     "threads for RPCs that may wait on I/O: put, get, alloc, commit, prefetch, flush, verify, "
     "evict, list (default 16)"},
    {"max_blocks_per_rpc", K_U32, OFF(max_blocks_per_rpc), 1, 4096, NULL,
     "most blocks in one Put/Get/Alloc (default 64)"},
    {"max_prompt_tokens", K_U32, OFF(max_prompt_tokens), 16, 16u << 20, NULL,
     "most tokens in one request (default 262144)"},
    {"key_cache_bytes", K_SIZE, OFF(key_cache_bytes), 0, UINT64_C(1) << 40, NULL,
     "memory for remembered block keys (prompts asked again skip SHA-256); 0 = off (default 32M)"},
    {"drain_timeout_ms", K_U32, OFF(drain_timeout_ms), 0, 3600000, NULL,
     "on SIGTERM, how long in-flight RPCs may run before they are cancelled (default 10000)"},
    {"log_level", K_ENUM, OFF(log_level), 0, 0, level_names, "error, warn, info, debug (default info)"},
    {"foreground", K_BOOL, OFF(foreground), 0, 1, NULL, "do not detach (default off)"},
};
#define NUM_KEYS (sizeof(kKeys) / sizeof(kKeys[0]))

/* ---- helpers -------------------------------------------------------------------------------- */

static void set_err(char *err, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t len, const char *fmt, ...)
{
    if (!err || !len)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

static const key_def *find_key(const char *name)
{
    for (size_t i = 0; i < NUM_KEYS; i++)
        if (strcmp(kKeys[i].name, name) == 0)
            return &kKeys[i];
    return NULL;
}

static void set_str(char **slot, const char *v)
{
    free(*slot);
    *slot = tkv_xstrdup(v);
}

/* Unsigned decimal (or 0x hex) with an optional K/M/G/T suffix (powers of 1024) for sizes. */
static int parse_u64(const char *s, bool allow_suffix, uint64_t *out)
{
    if (!*s || *s == '-' || *s == '+' || isspace((unsigned char)*s))
        return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s)
        return -1;
    unsigned shift = 0;
    if (allow_suffix && *end) {
        switch (toupper((unsigned char)*end)) {
        case 'K': shift = 10; break;
        case 'M': shift = 20; break;
        case 'G': shift = 30; break;
        case 'T': shift = 40; break;
        default: return -1;
        }
        end++;
        if (toupper((unsigned char)*end) == 'I')
            end++;
        if (toupper((unsigned char)*end) == 'B')
            end++;
    }
    if (*end)
        return -1;
    if (shift && v > (UINT64_MAX >> shift))
        return -1;
    *out = (uint64_t)v << shift;
    return 0;
}

static int parse_bool(const char *s, bool *out)
{
    static const char *const yes[] = {"1", "on", "true", "yes"};
    static const char *const no[] = {"0", "off", "false", "no"};
    for (size_t i = 0; i < 4; i++) {
        if (strcasecmp(s, yes[i]) == 0) {
            *out = true;
            return 0;
        }
        if (strcasecmp(s, no[i]) == 0) {
            *out = false;
            return 0;
        }
    }
    return -1;
}

static int enum_index(const char *const *names, const char *s)
{
    for (int i = 0; names[i]; i++)
        if (strcmp(names[i], s) == 0)
            return i;
    return -1;
}

static void enum_list(const char *const *names, char *buf, size_t len)
{
    size_t used = 0;
    buf[0] = 0;
    for (int i = 0; names[i] && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, "%s%s", i ? ", " : "", names[i]);
}

const char *tkvd_dtype_name(uint32_t dtype)
{
    return dtype < 2 ? dtype_names[dtype] : "unknown";
}
const char *tkvd_scale_mode_name(uint32_t mode)
{
    return mode < 2 ? scale_names[mode] : "unknown";
}
int tkvd_dtype_parse(const char *s)
{
    return enum_index(dtype_names, s);
}
int tkvd_scale_mode_parse(const char *s)
{
    return enum_index(scale_names, s);
}

/* ---- defaults ------------------------------------------------------------------------------- */

void tkvd_config_init(tkvd_config *c)
{
    memset(c, 0, sizeof(*c));
    /* The demo geometry: small enough that a 2-core machine replays a trace in minutes
     * (one block = 4 layers x K,V x 64 tokens x 2 heads x 64 dims = 64 KiB of FP8). */
    c->geometry.num_layers = 4;
    c->geometry.num_kv_heads = 2;
    c->geometry.head_dim = 64;
    c->geometry.block_tokens = 64;
    c->geometry.dtype = TKV_DTYPE_FP8_E4M3;
    c->geometry.scale_mode = TKV_SCALE_PER_TENSOR;
    snprintf(c->geometry.model_id, sizeof(c->geometry.model_id), "tierkv-demo");
    c->l2_bytes = UINT64_C(256) << 20;
    c->l1_bytes = UINT64_C(1) << 30;
    c->l3_read_mbps = 2000;
    c->attach_writable = true;
    c->l3_enabled = true;
    c->l3_dir = tkv_xstrdup("");
    c->zstd_level = 1;
    c->io_mode = TKV_IO_AUTO;
    c->write_through = true;
    c->policy = tkv_xstrdup("hazard");
    c->store_workers = 4;
    c->lease_ttl_ms = 30000;
    c->lease_ttl_max_ms = 600000;
    c->l4_redis_nodes = tkv_xstrdup("");
    c->l4_bytes_budget = UINT64_C(256) << 20;
    c->l4_connect_timeout_ms = 500;
    c->l4_timeout_ms = 2000;
    c->l4_connections = 4;
    c->l4_redis_user = tkv_xstrdup("");
    c->l4_redis_password = tkv_xstrdup("");
    c->data_dir = tkv_xstrdup("tierkv-data");
    c->run_dir = tkv_xstrdup("");
    c->pid_file = tkv_xstrdup("");
    c->log_file = tkv_xstrdup("");
    c->grpc_socket = tkv_xstrdup("");
    c->grpc_tcp = tkv_xstrdup("");
    c->tls_cert = tkv_xstrdup("");
    c->tls_key = tkv_xstrdup("");
    c->tls_client_ca = tkv_xstrdup("");
    c->attach_socket = tkv_xstrdup("");
    c->http_enabled = true;
    c->http_address = tkv_xstrdup("127.0.0.1");
    c->http_port = 9464;
    c->cq_threads = 2;
    c->rpc_workers = 16;
    c->max_blocks_per_rpc = 64;
    c->max_prompt_tokens = 262144;
    c->key_cache_bytes = UINT64_C(32) << 20;
    c->drain_timeout_ms = 10000;
    c->log_level = TKV_LOG_INFO;
    c->foreground = false;
}

void tkvd_config_free(tkvd_config *c)
{
    for (size_t i = 0; i < NUM_KEYS; i++) {
        if (kKeys[i].type == K_STR && kKeys[i].offset != GEO(model_id)) {
            char **slot = (char **)((char *)c + kKeys[i].offset);
            free(*slot);
            *slot = NULL;
        }
    }
    tkvd_tenants_free(&c->tenants);
}

/* ---- setting one key ------------------------------------------------------------------------ */

bool tkvd_config_has_key(const char *key)
{
    return find_key(key) != NULL;
}

bool tkvd_config_key_is_bool(const char *key)
{
    const key_def *k = find_key(key);
    return k && k->type == K_BOOL;
}

int tkvd_config_set(tkvd_config *c, const char *key, const char *value, const char *origin,
                    char *err, size_t err_len)
{
    if (strncmp(key, "tenant.", 7) == 0) {
        /* tenant.<name>.<field>: the field follows the last dot (names may hold dots). */
        const char *rest = key + 7, *dot = strrchr(rest, '.');
        if (!dot || dot == rest || !dot[1]) {
            set_err(err, err_len, "%s: '%s' is not tenant.<name>.<field>", origin, key);
            return TKV_EINVAL;
        }
        char name[TKVD_TENANT_NAME_MAX + 2];
        size_t nlen = (size_t)(dot - rest);
        if (nlen >= sizeof(name))
            nlen = sizeof(name) - 1; /* too long either way: the tenant table says so */
        memcpy(name, rest, nlen);
        name[nlen] = 0;
        return tkvd_tenants_set(&c->tenants, name, dot + 1, value, origin, err, err_len);
    }
    const key_def *k = find_key(key);
    if (!k) {
        set_err(err, err_len, "%s: unknown key '%s' (see tierkvd --help)", origin, key);
        return TKV_EINVAL;
    }
    void *slot = (char *)c + k->offset;
    uint64_t v;
    switch (k->type) {
    case K_U32:
    case K_U64:
    case K_SIZE:
        if (parse_u64(value, k->type == K_SIZE, &v) != 0) {
            set_err(err, err_len, "%s: %s: '%s' is not %s", origin, k->name, value,
                    k->type == K_SIZE ? "a size (bytes, or with a K/M/G/T suffix)"
                                      : "an unsigned integer");
            return TKV_EINVAL;
        }
        if (v < (uint64_t)k->min || v > k->max) {
            set_err(err, err_len, "%s: %s: %" PRIu64 " is out of range [%" PRId64 ", %" PRIu64 "]",
                    origin, k->name, v, k->min, k->max);
            return TKV_EINVAL;
        }
        if (k->type == K_U32)
            *(uint32_t *)slot = (uint32_t)v;
        else
            *(uint64_t *)slot = v;
        return TKV_OK;
    case K_INT: {
        char *end;
        errno = 0;
        long n = strtol(value, &end, 10);
        if (!*value || *end || errno) {
            set_err(err, err_len, "%s: %s: '%s' is not an integer", origin, k->name, value);
            return TKV_EINVAL;
        }
        if (n < k->min || n > (long)k->max) {
            set_err(err, err_len, "%s: %s: %ld is out of range [%" PRId64 ", %" PRIu64 "]", origin,
                    k->name, n, k->min, k->max);
            return TKV_EINVAL;
        }
        *(int *)slot = (int)n;
        return TKV_OK;
    }
    case K_BOOL:
        if (parse_bool(value, (bool *)slot) != 0) {
            set_err(err, err_len, "%s: %s: '%s' is not a boolean (on/off, true/false, yes/no, 1/0)",
                    origin, k->name, value);
            return TKV_EINVAL;
        }
        return TKV_OK;
    case K_ENUM: {
        int idx = enum_index(k->enum_names, value);
        if (idx < 0) {
            char list[128];
            enum_list(k->enum_names, list, sizeof(list));
            set_err(err, err_len, "%s: %s: '%s' is not one of: %s", origin, k->name, value, list);
            return TKV_EINVAL;
        }
        if (k->offset == GEO(dtype) || k->offset == GEO(scale_mode))
            *(uint32_t *)slot = (uint32_t)idx;
        else
            *(int *)slot = idx;
        return TKV_OK;
    }
    case K_STR: {
        size_t len = strlen(value);
        if (len < (size_t)k->min || len > k->max) {
            if (len < (size_t)k->min)
                set_err(err, err_len, "%s: %s: must not be empty", origin, k->name);
            else
                set_err(err, err_len, "%s: %s: too long (%zu bytes; at most %" PRIu64 ")", origin,
                        k->name, len, k->max);
            return TKV_EINVAL;
        }
        for (size_t i = 0; i < len; i++) {
            if (iscntrl((unsigned char)value[i])) {
                set_err(err, err_len, "%s: %s: control character in value", origin, k->name);
                return TKV_EINVAL;
            }
        }
        if (k->offset == GEO(model_id))
            memcpy(c->geometry.model_id, value, len + 1);
        else
            set_str((char **)slot, value);
        return TKV_OK;
    }
    }
    TKV_ASSERT(!"unhandled key type");
    return TKV_EINVAL;
}

/* ---- the file ------------------------------------------------------------------------------- */

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = 0;
    return s;
}

int tkvd_config_load(tkvd_config *c, const char *path, char *err, size_t err_len)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        set_err(err, err_len, "%s: cannot open config file: %s", path, strerror(errno));
        return TKV_EIO;
    }
    int rc = tkvd_config_read(c, f, path, err, err_len);
    fclose(f);
    return rc;
}

int tkvd_config_read(tkvd_config *c, FILE *f, const char *path, char *err, size_t err_len)
{
    int rc = TKV_OK;
    char line[4096];
    char origin[PATH_MAX + 32];
    unsigned lineno = 0;
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        snprintf(origin, sizeof(origin), "%s:%u", path, lineno);
        size_t n = strlen(line);
        if (n == sizeof(line) - 1 && line[n - 1] != '\n' && !feof(f)) {
            set_err(err, err_len, "%s: line too long (at most %zu bytes)", origin, sizeof(line) - 2);
            rc = TKV_EINVAL;
            goto out;
        }
        char *hash = strchr(line, '#');
        if (hash)
            *hash = 0;
        char *s = trim(line);
        if (!*s)
            continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            set_err(err, err_len, "%s: expected 'key = value', got '%s'", origin, s);
            rc = TKV_EINVAL;
            goto out;
        }
        *eq = 0;
        char *key = trim(s), *value = trim(eq + 1);
        /* Quotes are optional; they allow leading/trailing spaces and an empty value. */
        size_t vlen = strlen(value);
        if (vlen >= 2 && value[0] == '"' && value[vlen - 1] == '"') {
            value[vlen - 1] = 0;
            value++;
        }
        if (!*key) {
            set_err(err, err_len, "%s: missing key before '='", origin);
            rc = TKV_EINVAL;
            goto out;
        }
        rc = tkvd_config_set(c, key, value, origin, err, err_len);
        if (rc != TKV_OK)
            goto out;
    }
    if (ferror(f)) {
        set_err(err, err_len, "%s: read error", path);
        rc = TKV_EIO;
    }
out:
    return rc;
}

/* ---- whole-config checks and derived values ------------------------------------------------ */

static void derive_path(char **slot, const char *dir, const char *name)
{
    if (**slot)
        return;
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = tkv_xmalloc(n);
    snprintf(p, n, "%s/%s", dir, name);
    free(*slot);
    *slot = p;
}

static int check_socket_path(const char *key, const char *path, char *err, size_t err_len)
{
    if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
        set_err(err, err_len, "%s: '%s' is too long for a UNIX socket (at most %zu bytes); "
                "choose a shorter run_dir", key, path, sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
        return TKV_EINVAL;
    }
    return TKV_OK;
}

int tkvd_config_finish(tkvd_config *c, char *err, size_t err_len)
{
    char why[256];
    if (tkv_geometry_validate(&c->geometry, why, sizeof(why)) != TKV_OK) {
        set_err(err, err_len, "geometry: %s", why);
        return TKV_EINVAL;
    }
    c->block_bytes = tkv_geometry_block_bytes(&c->geometry);
    TKV_ASSERT(c->block_bytes > 0);
    tkv_geometry_fingerprint(&c->geometry, c->fingerprint);

    if (!tkv_policy_find(c->policy)) {
        char list[256] = "";
        size_t used = 0;
        for (const tkv_policy_ops *const *p = tkv_policy_all(); *p && used < sizeof(list); p++)
            used += (size_t)snprintf(list + used, sizeof(list) - used, "%s%s", used ? ", " : "",
                                     (*p)->name);
        set_err(err, err_len, "policy: unknown policy '%s' (known: %s)", c->policy, list);
        return TKV_EINVAL;
    }
    if (c->lease_ttl_ms > c->lease_ttl_max_ms) {
        set_err(err, err_len, "lease_ttl_ms (%u) must not exceed lease_ttl_max_ms (%u)",
                c->lease_ttl_ms, c->lease_ttl_max_ms);
        return TKV_EINVAL;
    }
    if (tkvd_config_l2_blocks(c) < 1) {
        set_err(err, err_len, "l2_bytes: %" PRIu64 " bytes hold no block of %zu bytes",
                c->l2_bytes, c->block_bytes);
        return TKV_EINVAL;
    }
    if (tkvd_config_l2_blocks(c) < c->max_blocks_per_rpc) {
        set_err(err, err_len, "l2: %" PRIu64 " blocks is less than max_blocks_per_rpc (%u)",
                tkvd_config_l2_blocks(c), c->max_blocks_per_rpc);
        return TKV_EINVAL;
    }
    /* One Put or Get message carries max_blocks_per_rpc payloads; keep it well inside what
     * gRPC's int-sized length limits can express. */
    if ((uint64_t)c->max_blocks_per_rpc * c->block_bytes > (UINT64_C(1) << 30)) {
        set_err(err, err_len, "max_blocks_per_rpc: %u blocks of %zu bytes exceed 1 GiB per message",
                c->max_blocks_per_rpc, c->block_bytes);
        return TKV_EINVAL;
    }
    if (*c->l4_redis_nodes) {
        char hosts[TKV_RC_MAX_NODES][64], why[160];
        int ports[TKV_RC_MAX_NODES];
        if (tkv_rc_parse_nodes(c->l4_redis_nodes, hosts, ports, TKV_RC_MAX_NODES, why,
                               sizeof(why)) < 0) {
            set_err(err, err_len, "l4_redis_nodes: %s", why);
            return TKV_EINVAL;
        }
    }
    if (*c->l4_redis_user && !*c->l4_redis_password) {
        set_err(err, err_len, "l4_redis_user needs l4_redis_password");
        return TKV_EINVAL;
    }
    if ((*c->l4_redis_user || *c->l4_redis_password) && !*c->l4_redis_nodes) {
        set_err(err, err_len, "l4_redis_user/l4_redis_password need l4_redis_nodes");
        return TKV_EINVAL;
    }
    if (!*c->tls_cert != !*c->tls_key) {
        set_err(err, err_len, "tls_cert and tls_key must be given together");
        return TKV_EINVAL;
    }
    if (*c->tls_cert && !*c->grpc_tcp) {
        set_err(err, err_len, "tls_cert/tls_key need grpc_tcp (TLS applies to the TCP listener)");
        return TKV_EINVAL;
    }
    for (const char *const *p = (const char *const[]){c->tls_cert, c->tls_key, NULL}; *p; p++) {
        if (**p && access(*p, R_OK) != 0) {
            set_err(err, err_len, "%s: cannot read '%s': %s", *p == c->tls_cert ? "tls_cert" : "tls_key",
                    *p, strerror(errno));
            return TKV_EINVAL;
        }
    }
    if (*c->tls_client_ca && !*c->tls_cert) {
        set_err(err, err_len, "tls_client_ca needs tls_cert/tls_key (client certificates are "
                "checked in the TLS handshake)");
        return TKV_EINVAL;
    }
    if (*c->tls_client_ca && access(c->tls_client_ca, R_OK) != 0) {
        set_err(err, err_len, "tls_client_ca: cannot read '%s': %s", c->tls_client_ca,
                strerror(errno));
        return TKV_EINVAL;
    }
    if (tkvd_tenants_finish(&c->tenants, err, err_len) != TKV_OK)
        return TKV_EINVAL;
    /* Each tenant's L2 is a region of its own: the regions must fit in L2. */
    if (tkvd_tenants_enabled(&c->tenants)) {
        uint64_t *regions = tkv_xcalloc(c->tenants.n, sizeof(*regions));
        int rc = tkvd_tenants_l2_regions(&c->tenants, tkvd_config_l2_blocks(c), regions, err,
                                         err_len);
        /* The same in L1 where the configuration asks for one (the GPU may still be absent
         * at start: then L1 is off and these are not used). */
        uint64_t l1_blocks = c->block_bytes ? c->l1_bytes / c->block_bytes : 0;
        if (rc == TKV_OK && l1_blocks)
            rc = tkvd_tenants_l1_regions(&c->tenants, l1_blocks, regions, err, err_len);
        free(regions);
        if (rc != TKV_OK)
            return TKV_EINVAL;
    }
    /* Guaranteed L3 shares must all fit at once, or a guarantee could not be kept. */
    uint64_t guaranteed = 0, l3_blocks = c->block_bytes ? c->l3_capacity_bytes / c->block_bytes : 0;
    for (size_t i = 0; i < c->tenants.n; i++)
        guaranteed += c->tenants.v[i]->guaranteed[3];
    if (c->l3_capacity_bytes && guaranteed > l3_blocks) {
        set_err(err, err_len, "tenants' guaranteed_l3_blocks add up to %llu, more than the %llu "
                "blocks of L3 (l3_capacity_bytes)", (unsigned long long)guaranteed,
                (unsigned long long)l3_blocks);
        return TKV_EINVAL;
    }
    if (*c->grpc_tcp && !strchr(c->grpc_tcp, ':')) {
        set_err(err, err_len, "grpc_tcp: '%s' is not host:port", c->grpc_tcp);
        return TKV_EINVAL;
    }

    if (!*c->run_dir) {
        char buf[PATH_MAX];
        const char *xdg = getenv("XDG_RUNTIME_DIR");
        if (geteuid() == 0)
            snprintf(buf, sizeof(buf), "/run/tierkv");
        else if (xdg && *xdg)
            snprintf(buf, sizeof(buf), "%s/tierkv", xdg);
        else
            snprintf(buf, sizeof(buf), "/tmp/tierkv-%u", (unsigned)geteuid());
        set_str(&c->run_dir, buf);
    }
    derive_path(&c->pid_file, c->run_dir, "tierkvd.pid");
    derive_path(&c->grpc_socket, c->run_dir, "tierkv.sock");
    derive_path(&c->attach_socket, c->run_dir, "attach.sock");
    derive_path(&c->l3_dir, c->data_dir, "l3");
    if (!*c->log_file && !c->foreground)
        derive_path(&c->log_file, c->data_dir, "tierkvd.log");
    if (check_socket_path("grpc_socket", c->grpc_socket, err, err_len) != TKV_OK ||
        check_socket_path("attach_socket", c->attach_socket, err, err_len) != TKV_OK)
        return TKV_EINVAL;
    if (strcmp(c->grpc_socket, c->attach_socket) == 0) {
        set_err(err, err_len, "grpc_socket and attach_socket must differ ('%s')", c->grpc_socket);
        return TKV_EINVAL;
    }
    return TKV_OK;
}

uint64_t tkvd_config_l2_blocks(const tkvd_config *c)
{
    if (c->l2_blocks)
        return c->l2_blocks;
    return c->block_bytes ? c->l2_bytes / c->block_bytes : 0;
}

/* ---- printing ------------------------------------------------------------------------------- */

static void print_value(const tkvd_config *c, const key_def *k, FILE *f)
{
    const void *slot = (const char *)c + k->offset;
    switch (k->type) {
    case K_U32: fprintf(f, "%u", *(const uint32_t *)slot); break;
    case K_U64:
    case K_SIZE: fprintf(f, "%" PRIu64, *(const uint64_t *)slot); break;
    case K_INT: fprintf(f, "%d", *(const int *)slot); break;
    case K_BOOL: fputs(*(const bool *)slot ? "on" : "off", f); break;
    case K_ENUM: {
        int idx = (k->offset == GEO(dtype) || k->offset == GEO(scale_mode))
                      ? (int)*(const uint32_t *)slot : *(const int *)slot;
        fputs(k->enum_names[idx], f);
        break;
    }
    case K_STR:
        if (k->offset == GEO(model_id))
            fprintf(f, "\"%s\"", c->geometry.model_id);
        else if (k->offset == OFF(l4_redis_password) && **(char *const *)slot)
            fputs("\"(set, not shown)\"", f);
        else
            fprintf(f, "\"%s\"", *(char *const *)slot);
        break;
    }
}

void tkvd_config_print_keys(FILE *f)
{
    for (size_t i = 0; i < NUM_KEYS; i++)
        fprintf(f, "  %-20s %s\n", kKeys[i].name, kKeys[i].help);
}

void tkvd_config_print(const tkvd_config *c, FILE *f)
{
    for (size_t i = 0; i < NUM_KEYS; i++) {
        fprintf(f, "%s = ", kKeys[i].name);
        print_value(c, &kKeys[i], f);
        fputc('\n', f);
    }
    tkvd_tenants_print(&c->tenants, f);
}

/* ---- the shared tier ------------------------------------------------------------------------ */

int tkvd_config_open_l4(const tkvd_config *c, tkv_l4 **out)
{
    tkv_l4_opts *o = tkv_l4_opts_new();
    int rc = TKV_EINVAL;
    if (tkv_l4_opts_set_nodes(o, c->l4_redis_nodes) != TKV_OK ||
        tkv_l4_opts_set_block(o, c->block_bytes, c->geometry.block_tokens) != TKV_OK ||
        tkv_l4_opts_set_auth(o, c->l4_redis_user, c->l4_redis_password) != TKV_OK ||
        tkv_l4_opts_set_timeouts(o, c->l4_connect_timeout_ms, c->l4_timeout_ms) != TKV_OK ||
        tkv_l4_opts_set_write_budget(o, c->l4_bytes_budget) != TKV_OK ||
        tkv_l4_opts_set_ttl_s(o, c->l4_ttl_s) != TKV_OK ||
        tkv_l4_opts_set_connections(o, c->l4_connections) != TKV_OK) {
        TKV_LOG(TKV_LOG_ERROR, "L4: the l4_* configuration was refused");
        goto out;
    }
    rc = tkv_l4_open(o, out);
    if (rc != TKV_OK)
        TKV_LOG(TKV_LOG_ERROR, "L4: cannot start: %s", tkv_strerror(rc));
out:
    tkv_l4_opts_free(o);
    return rc;
}

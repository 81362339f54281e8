/* tkvd_config.h - tierkvd's configuration: the embedded default, a `key = value` file, and
 * command-line overrides, validated once at start.
 *
 * Every key is documented in docs/config.md (and printed by `tierkvd --help`). Values are
 * applied in order -- defaults, then the file, then flags -- and checked as they are set
 * (unknown key, bad value, out of range: one message naming file:line or the flag), and then
 * as a whole by tkvd_config_finish() (geometry, TLS pairs, socket path lengths, derived
 * paths). Not thread-safe: it is built by main() before any thread starts and read-only after.
 */
#ifndef TKVD_CONFIG_H
#define TKVD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tkv_keys.h"
#include "tkvd_tenant.h"

#define TKVD_ERR_LEN 512

typedef struct tkvd_config {
    /* geometry: fixed for the daemon's life, stored in L3 through the fingerprint */
    tkv_geometry geometry;
    uint8_t fingerprint[TKV_KEY_BYTES];   /* derived by finish() */
    size_t block_bytes;                   /* derived by finish() */

    /* tiers */
    uint64_t l2_bytes;          /* host pool size; rounded down to whole blocks */
    uint64_t l2_blocks;         /* when nonzero, overrides l2_bytes */
    uint64_t l1_bytes;          /* GPU pool size; 0 = off (and off anyway without a GPU) */
    int gpu_device;             /* CUDA device ordinal of the L1 pool */
    uint32_t l3_read_mbps;      /* the cost check's L3 read-rate assumption */
    bool l3_enabled;
    char *l3_dir;               /* "" = <data_dir>/l3 */
    uint64_t l3_capacity_bytes; /* 0 = unlimited */
    int zstd_level;
    int io_mode;                /* TKV_IO_* */
    bool write_through;
    char *policy;
    unsigned store_workers;
    uint32_t lease_ttl_ms, lease_ttl_max_ms;

    /* the shared tier (L4); off when l4_redis_nodes is "" */
    char *l4_redis_nodes;       /* "host:port,..." seeds */
    uint64_t l4_bytes_budget;   /* write-down queue bytes; 0 = read-only L4 */
    uint32_t l4_connect_timeout_ms, l4_timeout_ms, l4_ttl_s, l4_connections;
    char *l4_redis_user, *l4_redis_password;

    /* paths ("" = derived by finish()) */
    char *data_dir, *run_dir, *pid_file, *log_file;

    /* sockets */
    char *grpc_socket;          /* UNIX socket path; "" = <run_dir>/tierkv.sock */
    char *grpc_tcp;             /* "host:port" or "" (off) */
    char *tls_cert, *tls_key;   /* PEM files; both or neither; only with grpc_tcp */
    char *tls_client_ca;        /* PEM CA bundle: TCP clients must present a certificate it
                                 * signed (mTLS); "" = no client certificate asked for */
    char *attach_socket;        /* "" = <run_dir>/attach.sock */
    bool attach_writable;       /* same-uid engines may map L2 writable */
    bool http_enabled;
    char *http_address;
    uint32_t http_port;         /* 0 = pick a free port (written to <run_dir>/tierkvd.http) */

    /* server */
    unsigned cq_threads;        /* completion-queue threads */
    unsigned rpc_workers;       /* threads for blocking RPCs (prefetch-wait, flush, verify) */
    uint32_t max_blocks_per_rpc;
    uint32_t max_prompt_tokens;
    uint64_t key_cache_bytes;   /* the memo of derived block keys (tkvd_keycache.h); 0 = off */
    uint32_t drain_timeout_ms;
    int log_level;
    bool foreground;

    /* tenants (`tenant.<name>.<field>` lines; none = the single default tenant) */
    tkvd_tenants tenants;
} tkvd_config;

/* Fills the embedded default (see docs/config.md). */
void tkvd_config_init(tkvd_config *c);
void tkvd_config_free(tkvd_config *c);

/* Sets one key from text (a `tenant.<name>.<field>` key goes to the tenant table). origin ("file:line" or "--flag") prefixes the message written to
 * err on failure. TKV_OK or TKV_EINVAL. */
int tkvd_config_set(tkvd_config *c, const char *key, const char *value, const char *origin,
                    char *err, size_t err_len);

/* Reads a `key = value` file ('#' comments, blank lines ignored). Stops at the first bad
 * line. TKV_OK, TKV_EINVAL (message in err), TKV_EIO (cannot read the file). */
int tkvd_config_load(tkvd_config *c, const char *path, char *err, size_t err_len);
/* The same from an open stream (left open); path names it in messages. */
int tkvd_config_read(tkvd_config *c, FILE *f, const char *path, char *err, size_t err_len);

/* True if key names a config key (flags are matched against the same table). */
bool tkvd_config_has_key(const char *key);
/* True if the key is a boolean (a flag may then be given without a value). */
bool tkvd_config_key_is_bool(const char *key);

/* Checks cross-key rules and derives paths, fingerprint, block size, L2 block count. */
int tkvd_config_finish(tkvd_config *c, char *err, size_t err_len);

/* Number of L2 blocks the store gets (valid after finish). */
uint64_t tkvd_config_l2_blocks(const tkvd_config *c);

/* Prints every key with its default and meaning (for --help). */
void tkvd_config_print_keys(FILE *f);
/* Prints the effective configuration as a config file (for --print-config). */
void tkvd_config_print(const tkvd_config *c, FILE *f);

/* Opens the shared tier as configured (l4_* keys; valid after finish, l4_redis_nodes set).
 * An unreachable cluster is not an error (the daemon serves from its local tiers and retries).
 * TKV_OK, or TKV_EINVAL with a log line. */
typedef struct tkv_l4 tkv_l4;
int tkvd_config_open_l4(const tkvd_config *c, tkv_l4 **out);

const char *tkvd_dtype_name(uint32_t dtype);
const char *tkvd_scale_mode_name(uint32_t mode);
int tkvd_dtype_parse(const char *s);       /* TKV_DTYPE_* or -1 */
int tkvd_scale_mode_parse(const char *s);  /* TKV_SCALE_* or -1 */

#endif

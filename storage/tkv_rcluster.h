/* tkv_rcluster.h - a small Redis Cluster client over hiredis (internal).
 *
 * Debian's hiredis 0.14 speaks to one server; this router makes a cluster look like one:
 * key -> slot (CRC16 of the key, or of its {hash tag}, mod 16384) -> the master serving that
 * slot, from the map `CLUSTER SLOTS` returns. A batch of commands goes out as one pipeline per
 * node, all nodes at once (non-blocking sockets under one poll loop), and MOVED / ASK answers
 * are followed (MOVED also updates the map and schedules a full reload). A node that cannot
 * be reached is retried with exponential back-off; while it backs off its commands fail at
 * once (TKV_EIO), so a dead master costs a cache miss, not a stall.
 *
 * Thread safety: none. One tkv_rc is one set of connections, used by one thread at a time
 * (the L4 tier keeps a small pool of them).
 */
#ifndef TKV_RCLUSTER_H
#define TKV_RCLUSTER_H

#include <stddef.h>
#include <stdint.h>

#include <hiredis/hiredis.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TKV_RC_SLOTS 16384
#define TKV_RC_MAX_NODES 64

/* CRC16-CCITT (XMODEM: poly 0x1021, init 0), the cluster specification's key hash:
 * tkv_rc_crc16("123456789", 9) == 0x31C3. */
uint16_t tkv_rc_crc16(const void *buf, size_t len);

/* The slot of a key: CRC16 of the part between the first '{' and the first '}' after it
 * when that part is non-empty, else of the whole key; mod 16384. */
uint16_t tkv_rc_key_slot(const void *key, size_t len);

/* Parses "host:port[,host:port...]" (at most TKV_RC_MAX_NODES entries; host a name or IPv4
 * address, port 1..65535). Returns the number of nodes, or TKV_EINVAL with a message in err. */
int tkv_rc_parse_nodes(const char *list, char hosts[][64], int *ports, int max, char *err,
                       size_t err_len);

typedef struct tkv_rc tkv_rc;

typedef struct tkv_rc_opts {
    const char *nodes;          /* seed list "host:port,..." (any nodes of the cluster) */
    const char *user;           /* ACL user for AUTH, or NULL/"" (the default user) */
    const char *password;       /* AUTH password, or NULL/"" (no AUTH) */
    uint32_t connect_timeout_ms;/* TCP connect + AUTH; default 500 */
    uint32_t timeout_ms;        /* one exec round's deadline; default 2000 */
    uint32_t backoff_max_ms;    /* longest wait between reconnects to a node; default 2000 */
} tkv_rc_opts;

/* Creates a router and tries to load the slot map. Never fails for an unreachable cluster
 * (every call then tries again, rate-limited): TKV_OK, or TKV_EINVAL for a bad seed list. */
int tkv_rc_open(const tkv_rc_opts *o, tkv_rc **out);
void tkv_rc_close(tkv_rc *rc);

/* One command of a batch. argv[key_arg] is the key it is routed by. */
typedef struct tkv_rc_cmd {
    int argc;
    const char **argv;
    const size_t *argvlen;
    int key_arg;                /* index of the key in argv (1 for GET/SET/EXISTS/DEL) */
    /* in, optional: when sum_reply is set and the answer is a string of at least sum_from
     * bytes, `sum` receives tkv_csum64 of its bytes [sum_from, len). A large string is summed
     * piece by piece as it comes off the socket, while those bytes are still in cache, instead
     * of in a second pass over the whole value once the batch is done. */
    int sum_reply;
    size_t sum_from;
    /* out: */
    redisReply *reply;          /* the answer (any type but a redirect); caller frees with
                                   tkv_rc_reply_free (or freeReplyObject); NULL when
                                   status != TKV_OK */
    int status;                 /* TKV_OK; TKV_EIO (node down, cluster down, error reply);
                                   TKV_ETIMEDOUT */
    int summed;                 /* 1 when `sum` holds the sum asked for by sum_reply */
    uint64_t sum;
} tkv_rc_cmd;

/* Runs the commands as one pipeline per node, following up to 5 redirects per command.
 * Order between commands of one node is kept; there is none across nodes. Returns TKV_OK
 * when every command got an answer (status OK), else the first failure. */
int tkv_rc_exec(tkv_rc *rc, tkv_rc_cmd *cmds, size_t n);

/* Buffers for large values, shared by every router of the process (thread-safe). Strings of
 * 64 KiB or more in replies are built in such buffers; tkv_rc_reply_free (or
 * tkv_rc_buf_release on the string) gives them back for the next reply instead of to the heap,
 * so a batch of large values does not grow and trim the heap every time. They are ordinary
 * malloc blocks: freeReplyObject / free on them is correct too (the buffer is not reused).
 * tkv_rc_buf_get never fails (aborts on out-of-memory, like tkv_xmalloc); release takes NULL. */
void *tkv_rc_buf_get(size_t bytes);
void tkv_rc_buf_release(void *p);
void tkv_rc_reply_free(redisReply *r);

/* Reloads the slot map now (a no-op when one was loaded in the last 100 ms). TKV_OK when a
 * node answered with a map covering every slot. */
int tkv_rc_refresh(tkv_rc *rc);

/* True when the last exec or refresh reached the cluster and found every slot served. */
int tkv_rc_healthy(const tkv_rc *rc);

typedef struct tkv_rc_stats {
    uint64_t commands, errors, timeouts;
    uint64_t moved, ask;              /* redirects followed */
    uint64_t connects, connect_failures, map_loads;
} tkv_rc_stats;

/* Adds this router's counters to *out (so a pool can sum them). */
void tkv_rc_add_stats(const tkv_rc *rc, tkv_rc_stats *out);

#ifdef __cplusplus
}
#endif
#endif

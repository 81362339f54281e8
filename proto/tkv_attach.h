/* tkv_attach.h - the attach-socket protocol (data plane set-up), shared by tierkvd and
 * libkvclient. Not protobuf: it is a local, fixed-layout handshake on a UNIX socket.
 *
 * Socket: SOCK_SEQPACKET at the daemon's attach path (default <run_dir>/attach.sock).
 *   1. client -> daemon: tkv_attach_hello.
 *   2. daemon -> client: tkv_attach_reply, with SCM_RIGHTS carrying the L2 pool's memfd when
 *      status == 0. The client maps it PROT_READ, MAP_SHARED (the daemon seals it against
 *      growing/shrinking); block bytes live at the l2_offset values Lookup returns.
 *   3. The connection stays open and silent. When it closes (client exit, crash, SIGKILL),
 *      the daemon releases every lease and allocation made with this client_id.
 * Fields are host-endian: both ends are on the same host.
 */
#ifndef TKV_ATTACH_H
#define TKV_ATTACH_H

#include <stdint.h>

#define TKV_ATTACH_MAGIC 0x41564b54u /* "TKVA" */
#define TKV_ATTACH_VERSION 1u

typedef struct tkv_attach_hello {
    uint32_t magic;
    uint32_t version;
    uint8_t fingerprint[32]; /* the client's geometry fingerprint */
    uint32_t flags;          /* TKV_ATTACH_HELLO_* */
    uint32_t pid;            /* informational */
} tkv_attach_hello;

/* Hello flag: the client asks for a writable L2 mapping (a trusted engine that writes its own
 * slots with the CPU kernels). Granted only to a peer of the daemon's own uid (or root) when
 * the daemon's attach_writable is on; the reply then has TKV_ATTACH_F_WRITABLE. Everyone else
 * gets a read-only descriptor: the kernel refuses a writable shared mapping of it. */
#define TKV_ATTACH_HELLO_WRITABLE 1u
/* Hello flag: the client will carry its critical-path calls on this connection (the fast
 * path below). The reply has TKV_ATTACH_F_FAST when the daemon serves them. */
#define TKV_ATTACH_HELLO_FAST 2u

typedef struct tkv_attach_reply {
    uint32_t magic;
    int32_t status;          /* 0, or a negative TKV_* code (tkv_base.h) */
    uint64_t client_id;      /* pass as BlockScope.client_id */
    uint64_t l2_bytes;       /* length to map */
    uint64_t block_bytes;
    uint32_t block_tokens;
    uint32_t flags;          /* TKV_ATTACH_F_L1: a GPU pool message follows;
                                TKV_ATTACH_F_WRITABLE: the descriptor may be mapped writable */
    char message[128];       /* reason when status != 0 */
} tkv_attach_reply;

/* GPU-tier extension: when the reply's flags has TKV_ATTACH_F_L1, a second message follows
 * on the same socket (no descriptors): the CUDA IPC handles of the L1 pool. The pool is
 * num_chunks allocations of chunk_bytes each (2 MiB multiples); an L1 byte offset `off` (as
 * Lookup/Alloc return) lives in chunk off / chunk_bytes at off % chunk_bytes. A client opens
 * each handle with cudaIpcOpenMemHandle on the device whose PCI bus id matches. */
#define TKV_ATTACH_F_L1 1u
#define TKV_ATTACH_F_WRITABLE 2u
#define TKV_ATTACH_F_FAST 4u
#define TKV_ATTACH_MAX_CHUNKS 64

typedef struct tkv_attach_gpu {
    uint32_t magic;          /* TKV_ATTACH_MAGIC */
    uint32_t num_chunks;     /* 1..TKV_ATTACH_MAX_CHUNKS */
    uint64_t chunk_bytes;
    uint64_t l1_bytes;       /* num_chunks * chunk_bytes */
    char pci_bus_id[32];     /* of the daemon's device, "0000:00:00.0" form */
    uint8_t handles[TKV_ATTACH_MAX_CHUNKS][64]; /* cudaIpcMemHandle_t, opaque */
} tkv_attach_gpu;

/* ---- the fast path ---------------------------------------------------------------------------
 * With TKV_ATTACH_F_FAST the connection carries calls after the handshake, one at a time:
 * the client sends a request, the daemon answers it, and only then does the next one start.
 * A message (request or reply) is one or more SEQPACKET records, each a tkv_fast_hdr and up
 * to TKV_FAST_FRAG_BYTES of payload; all but the last have TKV_FAST_MORE. Every record
 * repeats the message's total payload length. A request's payload is the serialized protobuf
 * request of the tierkv.v1.Cache method `op` names; a reply's is the serialized response when
 * status is 0 (gRPC OK), else the one-line error message (the same statuses and messages the
 * gRPC service gives). Lookups may use the lean encodings of proto/tkv_fast.h instead. A malformed record ends the connection, releasing its leases. */
#define TKV_FAST_MAGIC 0x46564b54u /* "TKVF" */
#define TKV_FAST_FRAG_BYTES (60u * 1024u) /* fits the default socket send buffer 3 times */
#define TKV_FAST_MORE 1u

enum {
    TKV_FAST_LOOKUP = 1,       /* Lookup */
    TKV_FAST_LOOKUP_BATCH = 2, /* LookupBatch */
    TKV_FAST_PREFETCH = 3,     /* Prefetch (with wait: kvc_wait) */
    TKV_FAST_RELEASE = 4,      /* Release */
    TKV_FAST_ALLOC = 5,        /* Alloc */
    TKV_FAST_WRITE_SLOT = 6,   /* WriteSlot */
    TKV_FAST_COMMIT = 7,       /* Commit */
    TKV_FAST_PUT = 8,          /* Put */
};

typedef struct tkv_fast_hdr {
    uint32_t magic;          /* TKV_FAST_MAGIC */
    uint16_t op;             /* TKV_FAST_* (the reply repeats it) */
    uint16_t flags;          /* TKV_FAST_MORE */
    uint32_t len;            /* the whole message's payload bytes */
    int32_t status;          /* reply: gRPC status code; request: 0 */
    uint32_t timeout_ms;     /* request: the client's deadline, 0 = none */
    uint32_t reserved;       /* 0 */
} tkv_fast_hdr;

#endif

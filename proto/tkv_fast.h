/* tkv_fast.h - the fast path's records and its lean lookup encoding (proto/tkv_attach.h has
 * the protocol), shared by tierkvd and libkvclient.
 *
 * Lookup and LookupBatch requests are most of an engine's calls and mostly tokens, which
 * protobuf sends as varints (a 1024-token prompt costs microseconds to pack and unpack). With
 * TKV_FAST_LEAN in the header flags their payload is instead:
 *   tkv_fast_lookup_hdr | uint32 num_tokens[num_prompts] | uint32 tokens[] (all prompts,
 *   in order) | namespace bytes (ns_len, no NUL)
 * host-endian, and decodes into the protobuf-c request structs without copying the tokens.
 * The successful reply to a lean request is lean too (TKV_FAST_LEAN in its header), because
 * a hit's block locations cost as much to pack and unpack as the lookup's own work:
 *   tkv_fast_reply_hdr | per result (1 for TKV_FAST_LOOKUP): tkv_fast_result |
 *   tkv_fast_loc[num_locs]
 * and decodes into the protobuf-c response structs, all in one allocation.
 * Every other request and reply is protobuf. */
#ifndef TKV_FAST_H
#define TKV_FAST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tierkv.pb-c.h"
#include "tkv_attach.h"

#define TKV_FAST_LEAN 2u        /* header flag: the payload is the lean lookup encoding */
#define TKV_FAST_MAX_PROMPTS 256

typedef struct tkv_fast_lookup_hdr {
    uint8_t fingerprint[32];
    uint64_t client_id;
    uint32_t ns_len;            /* at most 255 */
    uint32_t ttl_ms;
    uint32_t num_prompts;       /* 1 for TKV_FAST_LOOKUP; 0..TKV_FAST_MAX_PROMPTS for a batch */
    uint32_t reserved;          /* 0 */
} tkv_fast_lookup_hdr;

typedef struct tkv_fast_reply_hdr {
    uint32_t num_results;       /* 1 for TKV_FAST_LOOKUP; 0..TKV_FAST_MAX_PROMPTS for a batch */
    uint32_t reserved;          /* 0 */
} tkv_fast_reply_hdr;

typedef struct tkv_fast_result { /* a LookupResponse */
    uint64_t lease_id;
    uint32_t num_hit_blocks, num_hit_tokens, num_query_blocks;
    uint32_t num_locs;          /* tkv_fast_loc records that follow (its blocks) */
} tkv_fast_result;

typedef struct tkv_fast_loc {   /* a BlockLoc */
    uint64_t l2_offset, l1_offset;
    uint32_t tier;              /* Tier: 0..3 */
    uint8_t in_l2, in_l3, in_l1; /* 0 or 1 */
    uint8_t reserved;           /* 0 */
} tkv_fast_loc;

/* Where a lean request decodes to (large: keep one per connection, not on a small stack). */
typedef struct tkv_fast_lookup {
    Tierkv__V1__BlockScope scope;
    char ns[256];
    Tierkv__V1__LookupRequest single;
    Tierkv__V1__LookupBatchRequest batch;
    Tierkv__V1__Prompt prompts[TKV_FAST_MAX_PROMPTS];
    Tierkv__V1__Prompt *prompt_ptrs[TKV_FAST_MAX_PROMPTS];
} tkv_fast_lookup;

/* Bytes the lean encoding of rq (a LookupRequest or LookupBatchRequest) takes; 0 when it has
 * no lean form (more prompts than TKV_FAST_MAX_PROMPTS, a namespace over 255 bytes). */
size_t tkv_fast_lean_size(const ProtobufCMessage *rq);
/* Writes it to out (tkv_fast_lean_size bytes, 4-byte aligned). */
void tkv_fast_lean_encode(const ProtobufCMessage *rq, uint8_t *out);
/* Decodes a lean payload (4-byte aligned, len bytes) of op into *out; the tokens stay in p.
 * Returns the request (&out->single.base or &out->batch.base), or NULL with why set when the
 * lengths do not add up or a field is out of range. */
const ProtobufCMessage *tkv_fast_lean_decode(uint16_t op, const uint8_t *p, size_t len,
                                             tkv_fast_lookup *out, char *why, size_t why_cap);

/* Bytes the lean encoding of rsp (a LookupResponse or LookupBatchResponse) takes; 0 for any
 * other message or one past the limits (more results than TKV_FAST_MAX_PROMPTS). */
size_t tkv_fast_lean_reply_size(const ProtobufCMessage *rsp);
/* Writes it to out (tkv_fast_lean_reply_size bytes). */
void tkv_fast_lean_reply_encode(const ProtobufCMessage *rsp, uint8_t *out);
/* Decodes the lean reply (len bytes) to a call op into one malloc'ed block holding the
 * response message and everything it points to: release it with free(), never with
 * protobuf_c_message_free_unpacked. NULL with why set when the lengths do not add up or a
 * field is out of range. */
ProtobufCMessage *tkv_fast_lean_reply_decode(uint16_t op, const uint8_t *p, size_t len,
                                             char *why, size_t why_cap);

/* Receives one message on a blocking SEQPACKET socket into *buf (grown with realloc to the
 * message's length, which may be at most max; *cap is its size). Returns 1
 * with *hdr (the first record's header) and *len set; 0 when the peer closed the connection;
 * -1 on a malformed message or a failed call, with the reason in why. */
int tkv_fast_recv(int fd, tkv_fast_hdr *hdr, uint8_t **buf, size_t *cap, size_t max, size_t *len,
                  char *why, size_t why_cap);
/* Sends one message (payload p, len bytes) as records; flags (TKV_FAST_LEAN) go in every
 * record. False when the peer is gone. */
bool tkv_fast_send(int fd, uint16_t op, uint16_t flags, uint32_t timeout_ms, int32_t status,
                   const uint8_t *p, size_t len);

#endif

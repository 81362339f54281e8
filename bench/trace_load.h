/* trace_load.h - the Mooncake-format trace as trace_replay (and dev/trace_sim) read it: its
 * requests, the tree of its blocks, the store keys of every block, and the hit accounting and
 * printing every mode shares. Bench-local (not part of any library).
 *
 * Trace format (JSONL, one request a line): {"timestamp": ms, "input_length": tokens,
 * "output_length": tokens, "hash_ids": [id, ...]}, one id per 512-token trace block; equal ids
 * mean the same prefix up to and including that block. */
#ifndef TKV_BENCH_TRACE_LOAD_H
#define TKV_BENCH_TRACE_LOAD_H

#include "tkv_base.h"
#include "tkv_keys.h"
#include "tkv_store.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum { kTraceBlockTokens = 512 };

typedef struct trace_req {
    uint64_t timestamp_ms;
    uint32_t input_tokens;
    uint32_t num_blocks;
    size_t first; /* index into trace.ids / trace.nodes */
} trace_req;

typedef struct trace {
    trace_req *reqs;
    size_t num_reqs, cap_reqs;
    uint64_t *ids;     /* all hash ids, request after request */
    uint32_t *nodes;   /* dense node index of each id */
    size_t num_ids, cap_ids;
    uint64_t total_tokens;
    /* dense nodes: one per distinct id */
    uint64_t *node_id;
    int64_t *node_parent; /* node of the previous block, -1 for a chain's first block */
    uint32_t *node_depth;
    size_t num_nodes;
    size_t num_bad_lines;
} trace;

/* Loads a trace (the first max_reqs requests; 0 = all); prints each bad line (the first 10)
 * with its number and why. Bad lines are skipped and counted; TKV_EINVAL if no request is
 * left, TKV_EIO if the file cannot be read. */
int trace_load(const char *path, size_t max_reqs, trace *t);
/* The same from an open stream (left open); path names it in messages. */
int trace_read(FILE *f, const char *path, size_t max_reqs, trace *t);
void trace_free(trace *t);

/* The geometry the replay's blocks are keyed under, and every node's keys: the chain of its
 * P-token blocks, continuing its parent's chain (hashes every token of the trace once). */
typedef struct trace_keys {
    uint8_t fp[TKV_KEY_BYTES];
    tkv_key *node_keys; /* num_nodes * (512 / block_tokens) */
} trace_keys;
void trace_keys_build(const trace *t, uint32_t block_tokens, trace_keys *rk);
/* Deterministic token contents of a trace block: 512 tokens derived from its id. */
void trace_id_tokens(uint64_t id, uint32_t *out);

/* One replay's figures, in 512-token trace blocks. */
typedef struct trace_result {
    const char *policy;
    const char *mode;
    uint64_t capacity_blocks;
    uint64_t requests, blocks, hit_blocks;
    uint64_t tokens, hit_tokens;
    uint64_t hit_blocks_tier[TKV_NUM_TIERS]; /* in trace blocks */
    uint64_t evictions;
    /* in the store's own blocks (the store replay only, else 0): its capacity and hits */
    uint64_t store_capacity, store_hit_blocks;
    double seconds;
} trace_result;
double trace_now_s(void);
/* Request r was served with its first hit_trace_blocks blocks hit. */
void trace_account(trace_result *res, const trace_req *r, uint32_t hit_trace_blocks);
/* Sleeps the gap before request ir, divided by speedup (0: no sleeping). */
void trace_pace(const trace *t, size_t ir, double speedup);
/* The results as a JSON array (json) or a table, on stdout. */
void trace_print_results(const char *trace_path, const trace_result *results, size_t n,
                         uint64_t block_tokens, bool json);

#endif

/* trace_synth - writes a synthetic trace in the Mooncake format trace_replay reads, one reuse
 * mix at a time, so a policy can be checked against LRU on workloads other than the shipped
 * trace (docs/perf.md: the guard's table).
 *
 *   trace_synth --mix recency|scan|oneshot|multiturn [--requests N] [--seed S] > FILE.jsonl
 *
 * Mixes (each request is a chain of 512-token trace blocks; equal ids mean equal prefixes):
 *   recency    a request re-reads the chain of the request d back, d log-uniform in 1..20,000
 *              (reuse likelier the more recent: LRU's home ground), or starts a new one (30%),
 *              with a new block or two of question half of the time;
 *   scan       half of the requests walk a fixed loop of 1,250 chains of 16 blocks (20,000
 *              blocks: a cache smaller than that gets nothing from LRU there), the other half
 *              are recency requests;
 *   oneshot    85% one-off prompts of 20..80 new blocks, 15% one of 20 shared system prompts
 *              of 8 blocks (Zipf-like: prompt i with weight 1/(i+1)) plus 4 new blocks;
 *   multiturn  conversations: a turn re-sends the whole conversation so far and adds 2..10
 *              blocks; 70% of turns have a next one, log-uniform 1..5,000 requests later;
 *              a new conversation otherwise.
 * Deterministic for a given mix, size and seed. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct chain {
    uint64_t *ids;
    uint32_t len, cap;
} chain;

typedef struct gen {
    uint64_t rng, next_id;
    chain *chains;
    size_t num_chains, cap_chains;
} gen;

static uint64_t rnd(gen *g)
{
    g->rng ^= g->rng << 13;
    g->rng ^= g->rng >> 7;
    g->rng ^= g->rng << 17;
    return g->rng;
}

static double unit(gen *g) { return (double)(rnd(g) >> 11) / 9007199254740992.0; }

static uint32_t uniform(gen *g, uint32_t lo, uint32_t hi)
{
    return lo + (uint32_t)(rnd(g) % (uint64_t)(hi - lo + 1));
}

/* log-uniform in 1..max */
static uint64_t log_uniform(gen *g, uint64_t max) { return (uint64_t)exp(unit(g) * log((double)max)); }

static void push(chain *c, uint64_t id)
{
    if (c->len == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 16;
        c->ids = realloc(c->ids, c->cap * sizeof(*c->ids));
        if (!c->ids) {
            perror("trace_synth");
            exit(1);
        }
    }
    c->ids[c->len++] = id;
}

/* a new chain of n new blocks, or (base != SIZE_MAX) a copy of chain base's blocks followed
 * by n new ones */
static size_t new_chain(gen *g, size_t base, uint32_t n)
{
    if (g->num_chains == g->cap_chains) {
        g->cap_chains = g->cap_chains ? 2 * g->cap_chains : 1024;
        g->chains = realloc(g->chains, g->cap_chains * sizeof(*g->chains));
        if (!g->chains) {
            perror("trace_synth");
            exit(1);
        }
    }
    chain *c = &g->chains[g->num_chains];
    memset(c, 0, sizeof(*c));
    for (uint32_t k = 0; base != SIZE_MAX && k < g->chains[base].len; k++)
        push(c, g->chains[base].ids[k]);
    for (uint32_t k = 0; k < n; k++)
        push(c, g->next_id++);
    return g->num_chains++;
}

static void emit(gen *g, uint64_t q, const chain *c, uint32_t extra)
{
    uint32_t n = c->len + extra;
    printf("{\"timestamp\": %llu, \"input_length\": %u, \"output_length\": 16, \"hash_ids\": [",
           (unsigned long long)(q * 100), n * 512 - uniform(g, 0, 511));
    for (uint32_t k = 0; k < c->len; k++)
        printf("%s%llu", k ? ", " : "", (unsigned long long)c->ids[k]);
    for (uint32_t k = 0; k < extra; k++)
        printf(", %llu", (unsigned long long)g->next_id++);
    printf("]}\n");
}

int main(int argc, char **argv)
{
    const char *mix = NULL;
    uint64_t requests = 20000, seed = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--mix") == 0)
            mix = argv[i + 1];
        else if (strcmp(argv[i], "--requests") == 0)
            requests = strtoull(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--seed") == 0)
            seed = strtoull(argv[i + 1], NULL, 10);
        else
            mix = NULL, i = argc;
    }
    int kind = !mix ? -1
               : strcmp(mix, "recency") == 0   ? 0
               : strcmp(mix, "scan") == 0      ? 1
               : strcmp(mix, "oneshot") == 0   ? 2
               : strcmp(mix, "multiturn") == 0 ? 3
                                               : -1;
    if (kind < 0 || requests == 0 || (argc - 1) % 2) {
        fprintf(stderr, "usage: trace_synth --mix recency|scan|oneshot|multiturn "
                        "[--requests N] [--seed S]\n");
        return 2;
    }
    gen g = {.rng = 0x9e3779b97f4a7c15ull ^ (seed * 0xbf58476d1ce4e5b9ull), .next_id = 1};
    for (int i = 0; i < 8; i++)
        rnd(&g);
    enum { kLoopChains = 1250, kLoopBlocks = 16, kPrompts = 20, kMaxGap = 5000 };
    size_t *hist = calloc(requests, sizeof(*hist)); /* the chain each request read */
    size_t loop0 = 0, prompt0 = 0, loop_at = 0;
    double prompt_weight = 0;
    if (kind == 1) {
        loop0 = g.num_chains;
        for (size_t i = 0; i < kLoopChains; i++)
            new_chain(&g, SIZE_MAX, kLoopBlocks);
    }
    if (kind == 2) {
        prompt0 = g.num_chains;
        for (size_t i = 0; i < kPrompts; i++) {
            new_chain(&g, SIZE_MAX, 8);
            prompt_weight += 1.0 / (double)(i + 1);
        }
    }
    /* multiturn: conversations due at each request (a chain index per slot, a list each) */
    size_t *due_head = NULL, *due_next = NULL;
    if (kind == 3) {
        due_head = malloc((requests + kMaxGap + 1) * sizeof(*due_head));
        for (uint64_t q = 0; q <= requests + kMaxGap; q++)
            due_head[q] = SIZE_MAX;
    }
    size_t due_cap = 0;
    for (uint64_t q = 0; q < requests; q++) {
        size_t c;
        uint32_t extra = 0;
        bool recency_req = kind == 0 || (kind == 1 && (rnd(&g) & 1));
        if (recency_req) {
            uint64_t d = log_uniform(&g, 20000);
            if (q == 0 || unit(&g) < 0.3 || d > q) {
                c = new_chain(&g, SIZE_MAX, uniform(&g, 4, 40));
            } else {
                c = hist[q - d];
                extra = (rnd(&g) & 1) ? uniform(&g, 1, 2) : 0;
            }
        } else if (kind == 1) {
            c = loop0 + loop_at++ % kLoopChains;
        } else if (kind == 2) {
            if (unit(&g) < 0.85) {
                c = new_chain(&g, SIZE_MAX, uniform(&g, 20, 80));
            } else {
                double u = unit(&g) * prompt_weight;
                size_t i = 0;
                while (i + 1 < kPrompts && (u -= 1.0 / (double)(i + 1)) > 0)
                    i++;
                c = prompt0 + i;
                extra = 4;
            }
        } else {
            if (due_head[q] != SIZE_MAX) { /* a conversation's next turn is due */
                size_t prev = due_head[q];
                c = new_chain(&g, prev, uniform(&g, 2, 10));
                /* each turn's chain stands for the conversation from here on */
            } else {
                c = new_chain(&g, SIZE_MAX, uniform(&g, 2, 10));
            }
            if (unit(&g) < 0.7) {
                uint64_t when = q + log_uniform(&g, kMaxGap);
                if (when == q)
                    when++;
                while (when < requests + kMaxGap && due_head[when] != SIZE_MAX)
                    when++; /* one turn per request: the next free one */
                if (g.num_chains > due_cap) {
                    due_cap = 2 * g.num_chains;
                    due_next = realloc(due_next, due_cap * sizeof(*due_next));
                }
                due_next[c] = due_head[when];
                due_head[when] = c;
            }
        }
        hist[q] = c;
        emit(&g, q, &g.chains[c], extra);
    }
    for (size_t i = 0; i < g.num_chains; i++)
        free(g.chains[i].ids);
    free(g.chains);
    free(hist);
    free(due_head);
    free(due_next);
    return 0;
}

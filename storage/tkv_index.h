/* tkv_index.h - the block index (internal): 32-byte key -> block entry, chain structure,
 * longest-prefix probe, and the lease table.
 *
 * Locking (the store's; documented here because it is the index that it protects):
 *   idx_lock  a pthread rwlock held by the caller around every tkv_index_* call: read mode for
 *             find/prefix/foreach, write mode for insert/remove. Entry memory stays valid
 *             while any mode is held, because only a write-mode holder unlinks entries.
 *   state mu  the store's mutex for every mutable entry field (state, residency, pins, tier
 *             policy entries) and for the lease table. Taken after idx_lock, never before.
 * The index itself takes no locks, so lookups from many threads run in parallel under the read
 * lock; see docs/design.md for why the pin step is one short critical section.
 *
 * Chain structure: each entry knows its parent key. When the parent entry is indexed the two
 * are linked (entry->parent, parent's children list); otherwise the entry waits in the orphan
 * map under its parent key and is adopted when that key is inserted (blocks loaded from L3 in
 * key order, or a parent re-put after it was dropped). Depth is "best known": the parent's
 * depth + 1 when linked, else what the caller said.
 */
#ifndef TKV_INDEX_H
#define TKV_INDEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tkv_keys.h"
#include "tkv_policy.h"
#include "tkv_store.h"

typedef struct tkv_entry {
    tkv_key key;
    tkv_key parent_key;          /* all zero = chain root unknown / block 0 */
    struct tkv_entry *parent;    /* indexed parent, or NULL */
    struct tkv_entry *first_child, *next_sibling, *prev_sibling;
    struct tkv_entry *orphan_next; /* orphan-map chain while parent == NULL */
    uint32_t depth;
    uint8_t state;               /* TKV_BLOCK_* */
    uint8_t linked;              /* in the hash table */
    uint8_t resident;            /* bit (1 << tier) per tier holding it */
    uint8_t flags;               /* store-private */
    uint8_t tenant;              /* tenant id (tkv_store.h), set at put/commit */
    int16_t promote_err;         /* result of the last promotion attempt (TKV_*) */
    uint32_t pins;               /* leases + in-flight I/O; never evicted while nonzero */
    uint32_t num_tokens;
    uint32_t *tokens;            /* kept until durable in L3 (needed by the L3 record) */
    uint64_t l2_slot;            /* valid when resident in L2 or WRITING */
    uint64_t l1_slot;            /* valid when resident in L1 */
    uint64_t csum;               /* tkv_csum64 of the payload, when flags say it is known */
    uint64_t hits, last_access_ms;
    struct tkv_entry *q_next;    /* store-private queue link (write-back) */
    tkv_policy_entry pe[TKV_NUM_TIERS]; /* one per tier; valid while resident there */
} tkv_entry;

typedef struct tkv_index tkv_index;

tkv_index *tkv_index_new(uint64_t expected_entries);
/* Frees the table and every entry still in it (entries not in it are the caller's). */
void tkv_index_free(tkv_index *ix);

/* Allocates a zeroed entry with key and parent key set (not inserted). */
tkv_entry *tkv_entry_new(const tkv_key *key, const tkv_key *parent_key, uint32_t depth);
void tkv_entry_free(tkv_entry *e);

tkv_entry *tkv_index_find(const tkv_index *ix, const tkv_key *key);
/* Inserts e (TKV_EEXIST if its key is present), links it to its parent and adopts orphans
 * whose parent key is e's key. Write lock. */
int tkv_index_insert(tkv_index *ix, tkv_entry *e);
/* Unlinks e from the table and the chain structure (children become orphans). Write lock.
 * The entry itself is not freed. */
void tkv_index_remove(tkv_index *ix, tkv_entry *e);
uint64_t tkv_index_count(const tkv_index *ix);
/* Entries found for keys[0..n) in order, stopping at the first key not indexed; returns how
 * many were found (state is not checked here: the caller checks it under the state lock). */
size_t tkv_index_prefix(const tkv_index *ix, const tkv_key *keys, size_t n, tkv_entry **out);
/* Calls cb for every entry; stops when cb returns nonzero (and returns that value). */
int tkv_index_foreach(const tkv_index *ix, int (*cb)(void *arg, tkv_entry *e), void *arg);

/* ---- leases (state lock held) ------------------------------------------------------------ */
typedef struct tkv_lease {
    uint64_t id, owner;
    uint64_t deadline_ns;
    uint64_t expired_at_ns;      /* nonzero once expired: entries released, record kept */
    size_t num_entries;
    tkv_entry **entries;         /* pinned by this lease (the store did the pinning) */
    struct tkv_lease *next;      /* hash chain */
} tkv_lease;

typedef struct tkv_lease_table tkv_lease_table;

tkv_lease_table *tkv_lease_table_new(void);
/* Frees the table and lease records (not the entries they name). */
void tkv_lease_table_free(tkv_lease_table *t);
/* New lease owning a copy of entries[0..n); ids start at 1 and never repeat. */
tkv_lease *tkv_lease_add(tkv_lease_table *t, uint64_t owner, uint64_t deadline_ns,
                         tkv_entry *const *entries, size_t n);
tkv_lease *tkv_lease_get(tkv_lease_table *t, uint64_t id);
/* Unlinks and frees a lease record (the caller unpinned its entries first). */
void tkv_lease_del(tkv_lease_table *t, tkv_lease *l);
uint64_t tkv_lease_count(const tkv_lease_table *t);  /* live (not expired) leases */
/* Calls cb for every lease record; cb may tkv_lease_del() the one it is given. */
void tkv_lease_foreach(tkv_lease_table *t, void (*cb)(void *arg, tkv_lease *l), void *arg);
/* Marks l expired (the caller unpinned its entries): frees its entry list, keeps the record so
 * a later call can answer TKV_EXPIRED rather than TKV_ENOTFOUND. */
void tkv_lease_mark_expired(tkv_lease_table *t, tkv_lease *l, uint64_t now_ns);

#endif

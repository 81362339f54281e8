/* tkv_pool.h - the L2 host pool (internal): fixed-size slots carved from ONE memfd-backed
 * shared mapping, so the whole pool can be handed to local clients as one file descriptor
 * (SCM_RIGHTS) and mapped read-only there.
 *
 * Slot i lives at byte offset i * slot_stride. slot_stride is slot_bytes rounded up to 4096 so
 * every slot is page aligned (O_DIRECT reads land straight in a slot; clients can mprotect or
 * map single slots). The file is sealed against growing and shrinking (F_SEAL_GROW |
 * F_SEAL_SHRINK) so a client can trust its mapping never turns into SIGBUS. The mapping is
 * populated at creation (the whole pool is committed memory from the start).
 *
 * Free-slot accounting: a stack of free slot indices plus one state byte per slot; a double
 * free or a free of a slot that was never handed out is a TKV_ASSERT (a bug, never input).
 * Thread safety: alloc/free/counters take the pool's own mutex; slot memory is the caller's
 * to synchronise.
 */
#ifndef TKV_POOL_H
#define TKV_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef struct tkv_pool tkv_pool;

#define TKV_POOL_MAX_SLOTS (1ull << 31)

/* Creates the memfd (named `name`, for /proc/<pid>/fd), sizes it to num_slots * stride,
 * seals it and maps it shared read-write. TKV_EINVAL for 0 sizes or a size that overflows;
 * TKV_EIO (with a log line) when the kernel refuses memfd_create/ftruncate/mmap. */
int tkv_pool_create(const char *name, size_t slot_bytes, uint64_t num_slots, tkv_pool **out);
/* Unmaps and closes. Slots still allocated are simply gone. NULL is ignored. */
void tkv_pool_destroy(tkv_pool *p);

/* All-or-nothing: n free slots into slots[] (TKV_OK), or TKV_EFULL and nothing taken. */
int tkv_pool_alloc(tkv_pool *p, size_t n, uint64_t *slots);
/* Returns a slot taken by tkv_pool_alloc. */
void tkv_pool_free(tkv_pool *p, uint64_t slot);

uint64_t tkv_pool_num_slots(const tkv_pool *p);
uint64_t tkv_pool_num_free(tkv_pool *p);
size_t tkv_pool_slot_bytes(const tkv_pool *p);
size_t tkv_pool_slot_stride(const tkv_pool *p);
int tkv_pool_fd(const tkv_pool *p);
/* The same memory through a read-only file description (what untrusted clients receive:
 * a writable shared mapping of it is refused by the kernel). */
int tkv_pool_fd_readonly(const tkv_pool *p);
uint64_t tkv_pool_bytes(const tkv_pool *p);   /* mapped length */
void *tkv_pool_base(const tkv_pool *p);
/* Slot memory; slot < num_slots (asserted). */
void *tkv_pool_slot_ptr(const tkv_pool *p, uint64_t slot);
/* Slot holding byte offset `offset` if it is the start of a slot, else UINT64_MAX. */
uint64_t tkv_pool_slot_of_offset(const tkv_pool *p, uint64_t offset);
/* 1 if the slot is currently allocated (for tests and consistency checks). */
int tkv_pool_slot_used(tkv_pool *p, uint64_t slot);

#endif

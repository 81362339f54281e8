/* tkv_pool.h - the L2 host pool (internal): fixed-size slots in one contiguous shared mapping
 * of the daemon, made of one or more REGIONS, each its own memfd, so a region can be handed to
 * local clients as one file descriptor (SCM_RIGHTS) and mapped there without the others: a
 * client of one region can name no byte of another. The daemon gives each tenant a region.
 *
 * Slots are numbered across the pool: region r holds slots [first(r), first(r) + num(r)), its
 * memfd is mapped at byte first(r) * slot_stride of the pool, and slot i lives at byte offset
 * i * slot_stride of the pool (at (i - first(r)) * slot_stride of its region's memfd). slot_stride is slot_bytes rounded up to 4096 so
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
#define TKV_POOL_MAX_REGIONS 128

/* Creates the memfd (named `name`, for /proc/<pid>/fd), sizes it to num_slots * stride,
 * seals it and maps it shared read-write. TKV_EINVAL for 0 sizes or a size that overflows;
 * TKV_EIO (with a log line) when the kernel refuses memfd_create/ftruncate/mmap. */
int tkv_pool_create(const char *name, size_t slot_bytes, uint64_t num_slots, tkv_pool **out);
/* A pool of num_regions regions of region_slots[r] slots each (0 allowed, not all 0): a memfd
 * per non-empty region, named `name`-r<r>, mapped back to back. Errors as tkv_pool_create. */
int tkv_pool_create_regions(const char *name, size_t slot_bytes, const uint64_t *region_slots,
                            unsigned num_regions, tkv_pool **out);
/* Unmaps and closes. Slots still allocated are simply gone. NULL is ignored. */
void tkv_pool_destroy(tkv_pool *p);

/* All-or-nothing: n free slots of region 0 into slots[] (TKV_OK), or TKV_EFULL and nothing
 * taken. tkv_pool_alloc_in takes them from region r (< num_regions, asserted). */
int tkv_pool_alloc(tkv_pool *p, size_t n, uint64_t *slots);
int tkv_pool_alloc_in(tkv_pool *p, unsigned r, size_t n, uint64_t *slots);
/* Returns a slot taken by tkv_pool_alloc(_in) to its region. */
void tkv_pool_free(tkv_pool *p, uint64_t slot);

unsigned tkv_pool_num_regions(const tkv_pool *p);
uint64_t tkv_pool_num_free_in(tkv_pool *p, unsigned r);
/* Region r's first slot, slot count, memfd and read-only reopen of it (-1 for an empty
 * region), and the region of a slot (< num_slots, asserted). r < num_regions (asserted). */
uint64_t tkv_pool_region_first(const tkv_pool *p, unsigned r);
uint64_t tkv_pool_region_slots(const tkv_pool *p, unsigned r);
int tkv_pool_region_fd(const tkv_pool *p, unsigned r);
int tkv_pool_region_fd_readonly(const tkv_pool *p, unsigned r);
unsigned tkv_pool_region_of(const tkv_pool *p, uint64_t slot);

uint64_t tkv_pool_num_slots(const tkv_pool *p);
uint64_t tkv_pool_num_free(tkv_pool *p);   /* over every region */
size_t tkv_pool_slot_bytes(const tkv_pool *p);
size_t tkv_pool_slot_stride(const tkv_pool *p);
/* Region 0's memfd (the whole pool when there is one region). */
int tkv_pool_fd(const tkv_pool *p);
/* The same memory through a read-only file description (what untrusted clients receive:
 * a writable shared mapping of it is refused by the kernel). */
int tkv_pool_fd_readonly(const tkv_pool *p);
uint64_t tkv_pool_bytes(const tkv_pool *p);   /* mapped length, every region */
void *tkv_pool_base(const tkv_pool *p);
/* Slot memory; slot < num_slots (asserted). */
void *tkv_pool_slot_ptr(const tkv_pool *p, uint64_t slot);
/* Slot holding byte offset `offset` if it is the start of a slot, else UINT64_MAX. */
uint64_t tkv_pool_slot_of_offset(const tkv_pool *p, uint64_t offset);
/* 1 if the slot is currently allocated (for tests and consistency checks). */
int tkv_pool_slot_used(tkv_pool *p, uint64_t slot);

#endif

/* pool.c - the L2 host pool: slots in sealed memfd regions mapped back to back (see
 * tkv_pool.h). */
#include "tkv_pool.h"

#include "tkv_base.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct pool_region {
    int fd;      /* its memfd, or -1 when empty */
    int ro_fd;   /* the same memory through a read-only file description, for clients */
    uint64_t first, num;
    uint32_t *free_stack;    /* free slot indices (pool-wide); top at num_free - 1 */
    uint64_t num_free;
} pool_region;

struct tkv_pool {
    void *base;
    uint64_t bytes;
    size_t slot_bytes, slot_stride;
    uint64_t num_slots;
    pthread_mutex_t mu;
    unsigned num_regions;
    pool_region *regions;
    uint8_t *used;           /* one byte per slot: 1 while handed out */
};

#define POOL_PAGE 4096u

/* Creates region r's memfd, seals it and maps it at its place in the reserved range. */
static int region_map(tkv_pool *p, const char *name, unsigned r)
{
    pool_region *g = &p->regions[r];
    uint64_t bytes = g->num * p->slot_stride;
    char label[96];
    snprintf(label, sizeof(label), "%s-r%u", name, r);
    g->fd = memfd_create(p->num_regions > 1 ? label : name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (g->fd < 0) {
        TKV_LOG(TKV_LOG_ERROR, "memfd_create: %s", strerror(errno));
        return TKV_EIO;
    }
    if (ftruncate(g->fd, (off_t)bytes) != 0) {
        TKV_LOG(TKV_LOG_ERROR, "ftruncate memfd to %llu bytes: %s", (unsigned long long)bytes,
                strerror(errno));
        return TKV_EIO;
    }
    /* Sealed before anyone else can see the fd: a client's mapping can never lose its pages. */
    if (fcntl(g->fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
        TKV_LOG(TKV_LOG_ERROR, "sealing memfd: %s", strerror(errno));
        return TKV_EIO;
    }
    /* A client's descriptor must not allow a writable shared mapping: reopening the memfd
     * through /proc with O_RDONLY gives a file description mmap(PROT_WRITE, MAP_SHARED)
     * refuses. */
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", g->fd);
    g->ro_fd = open(path, O_RDONLY | O_CLOEXEC);
    if (g->ro_fd < 0) {
        TKV_LOG(TKV_LOG_ERROR, "read-only reopen of the pool memfd: %s", strerror(errno));
        return TKV_EIO;
    }
    /* MAP_POPULATE: the pool is memory the operator gave the cache, so take it now. A first
     * touch of a shmem page costs several times the copy into it (measured: put into a fresh
     * pool ran at ~1/5 the speed of a warm one), and the GPU tier registers the whole range
     * with the driver anyway. MAP_FIXED over our own reservation: the regions sit back to
     * back, so the store addresses every slot from one base. */
    void *at = (uint8_t *)p->base + g->first * p->slot_stride;
    if (mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, g->fd,
             0) == MAP_FAILED) {
        TKV_LOG(TKV_LOG_ERROR, "mmap of %llu-byte pool region: %s", (unsigned long long)bytes,
                strerror(errno));
        return TKV_EIO;
    }
    g->free_stack = tkv_xmalloc((g->num ? g->num : 1) * sizeof(uint32_t));
    /* Lowest slot on top, so a fresh region hands out slots in address order. */
    for (uint64_t i = 0; i < g->num; i++)
        g->free_stack[i] = (uint32_t)(g->first + g->num - 1 - i);
    g->num_free = g->num;
    return TKV_OK;
}

int tkv_pool_create_regions(const char *name, size_t slot_bytes, const uint64_t *region_slots,
                            unsigned num_regions, tkv_pool **out)
{
    tkv_pool *p = NULL;
    int rc = TKV_EINVAL;
    if (!out || slot_bytes == 0 || !region_slots || num_regions == 0 ||
        num_regions > TKV_POOL_MAX_REGIONS)
        goto fail;
    if (slot_bytes > SIZE_MAX - POOL_PAGE)
        goto fail;
    uint64_t num_slots = 0;
    for (unsigned r = 0; r < num_regions; r++) {
        if (region_slots[r] > TKV_POOL_MAX_SLOTS - num_slots)
            goto fail;
        num_slots += region_slots[r];
    }
    if (num_slots == 0)
        goto fail;
    size_t stride = (slot_bytes + POOL_PAGE - 1) & ~(size_t)(POOL_PAGE - 1);
    if (num_slots > UINT64_MAX / stride || num_slots * stride > (uint64_t)SIZE_MAX / 2)
        goto fail;

    p = tkv_xcalloc(1, sizeof(*p));
    p->base = MAP_FAILED;
    p->slot_bytes = slot_bytes;
    p->slot_stride = stride;
    p->num_slots = num_slots;
    p->bytes = num_slots * stride;
    p->num_regions = num_regions;
    p->regions = tkv_xcalloc(num_regions, sizeof(*p->regions));
    for (unsigned r = 0; r < num_regions; r++)
        p->regions[r].fd = p->regions[r].ro_fd = -1;
    pthread_mutex_init(&p->mu, NULL);

    rc = TKV_EIO;
    /* One reserved range, then each region's memfd mapped over its part of it. */
    p->base = mmap(NULL, p->bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p->base == MAP_FAILED) {
        TKV_LOG(TKV_LOG_ERROR, "reserving %llu bytes for the pool: %s",
                (unsigned long long)p->bytes, strerror(errno));
        goto fail;
    }
    uint64_t first = 0;
    for (unsigned r = 0; r < num_regions; r++) {
        p->regions[r].first = first;
        p->regions[r].num = region_slots[r];
        first += region_slots[r];
        if (region_slots[r] && (rc = region_map(p, name ? name : "tierkv-l2", r)) != TKV_OK)
            goto fail;
    }
    p->used = tkv_xcalloc(num_slots, 1);
    *out = p;
    return TKV_OK;

fail:
    tkv_pool_destroy(p);
    if (out)
        *out = NULL;
    return rc;
}

int tkv_pool_create(const char *name, size_t slot_bytes, uint64_t num_slots, tkv_pool **out)
{
    if (num_slots == 0) {
        if (out)
            *out = NULL;
        return TKV_EINVAL;
    }
    return tkv_pool_create_regions(name, slot_bytes, &num_slots, 1, out);
}

void tkv_pool_destroy(tkv_pool *p)
{
    if (!p)
        return;
    if (p->base != MAP_FAILED)
        munmap(p->base, p->bytes);
    for (unsigned r = 0; p->regions && r < p->num_regions; r++) {
        if (p->regions[r].fd >= 0)
            close(p->regions[r].fd);
        if (p->regions[r].ro_fd >= 0)
            close(p->regions[r].ro_fd);
        free(p->regions[r].free_stack);
    }
    free(p->regions);
    pthread_mutex_destroy(&p->mu);
    free(p->used);
    free(p);
}

int tkv_pool_alloc_in(tkv_pool *p, unsigned r, size_t n, uint64_t *slots)
{
    TKV_ASSERT(r < p->num_regions);
    pool_region *g = &p->regions[r];
    pthread_mutex_lock(&p->mu);
    if (n > g->num_free) {
        pthread_mutex_unlock(&p->mu);
        return TKV_EFULL;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t s = g->free_stack[--g->num_free];
        TKV_ASSERT(!p->used[s]);
        p->used[s] = 1;
        slots[i] = s;
    }
    pthread_mutex_unlock(&p->mu);
    return TKV_OK;
}

int tkv_pool_alloc(tkv_pool *p, size_t n, uint64_t *slots)
{
    return tkv_pool_alloc_in(p, 0, n, slots);
}

unsigned tkv_pool_region_of(const tkv_pool *p, uint64_t slot)
{
    TKV_ASSERT(slot < p->num_slots);
    unsigned lo = 0, hi = p->num_regions; /* the last region whose first slot is <= slot */
    while (hi - lo > 1) {
        unsigned mid = (lo + hi) / 2;
        if (p->regions[mid].first <= slot)
            lo = mid;
        else
            hi = mid;
    }
    while (p->regions[lo].num == 0 || slot >= p->regions[lo].first + p->regions[lo].num)
        lo++; /* empty regions share their first slot with the next one */
    return lo;
}

void tkv_pool_free(tkv_pool *p, uint64_t slot)
{
    pool_region *g = &p->regions[tkv_pool_region_of(p, slot)];
    pthread_mutex_lock(&p->mu);
    TKV_ASSERT(p->used[slot]);
    TKV_ASSERT(g->num_free < g->num);
    p->used[slot] = 0;
    g->free_stack[g->num_free++] = (uint32_t)slot;
    pthread_mutex_unlock(&p->mu);
}

uint64_t tkv_pool_num_slots(const tkv_pool *p) { return p->num_slots; }
size_t tkv_pool_slot_bytes(const tkv_pool *p) { return p->slot_bytes; }
size_t tkv_pool_slot_stride(const tkv_pool *p) { return p->slot_stride; }
int tkv_pool_fd(const tkv_pool *p) { return p->regions[0].fd; }
int tkv_pool_fd_readonly(const tkv_pool *p) { return p->regions[0].ro_fd; }
unsigned tkv_pool_num_regions(const tkv_pool *p) { return p->num_regions; }

static const pool_region *region_at(const tkv_pool *p, unsigned r)
{
    TKV_ASSERT(r < p->num_regions);
    return &p->regions[r];
}
uint64_t tkv_pool_region_first(const tkv_pool *p, unsigned r) { return region_at(p, r)->first; }
uint64_t tkv_pool_region_slots(const tkv_pool *p, unsigned r) { return region_at(p, r)->num; }
int tkv_pool_region_fd(const tkv_pool *p, unsigned r) { return region_at(p, r)->fd; }
int tkv_pool_region_fd_readonly(const tkv_pool *p, unsigned r) { return region_at(p, r)->ro_fd; }

uint64_t tkv_pool_num_free_in(tkv_pool *p, unsigned r)
{
    const pool_region *g = region_at(p, r);
    pthread_mutex_lock(&p->mu);
    uint64_t n = g->num_free;
    pthread_mutex_unlock(&p->mu);
    return n;
}
uint64_t tkv_pool_bytes(const tkv_pool *p) { return p->bytes; }
void *tkv_pool_base(const tkv_pool *p) { return p->base; }

uint64_t tkv_pool_num_free(tkv_pool *p)
{
    pthread_mutex_lock(&p->mu);
    uint64_t n = 0;
    for (unsigned r = 0; r < p->num_regions; r++)
        n += p->regions[r].num_free;
    pthread_mutex_unlock(&p->mu);
    return n;
}

void *tkv_pool_slot_ptr(const tkv_pool *p, uint64_t slot)
{
    TKV_ASSERT(slot < p->num_slots);
    return (uint8_t *)p->base + slot * p->slot_stride;
}

uint64_t tkv_pool_slot_of_offset(const tkv_pool *p, uint64_t offset)
{
    if (offset % p->slot_stride != 0 || offset / p->slot_stride >= p->num_slots)
        return UINT64_MAX;
    return offset / p->slot_stride;
}

int tkv_pool_slot_used(tkv_pool *p, uint64_t slot)
{
    if (slot >= p->num_slots)
        return 0;
    pthread_mutex_lock(&p->mu);
    int u = p->used[slot];
    pthread_mutex_unlock(&p->mu);
    return u;
}

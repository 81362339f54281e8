/* pool.c - the L2 host pool: slots in one sealed memfd mapping (see tkv_pool.h). */
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

struct tkv_pool {
    int fd;
    int ro_fd;   /* the same memory through a read-only file description, for clients */
    void *base;
    uint64_t bytes;
    size_t slot_bytes, slot_stride;
    uint64_t num_slots;
    pthread_mutex_t mu;
    uint32_t *free_stack;    /* free slot indices; top at num_free - 1 */
    uint64_t num_free;
    uint8_t *used;           /* one byte per slot: 1 while handed out */
};

#define POOL_PAGE 4096u

int tkv_pool_create(const char *name, size_t slot_bytes, uint64_t num_slots, tkv_pool **out)
{
    tkv_pool *p = NULL;
    int rc = TKV_EINVAL;
    if (!out || slot_bytes == 0 || num_slots == 0 || num_slots > TKV_POOL_MAX_SLOTS)
        goto fail;
    if (slot_bytes > SIZE_MAX - POOL_PAGE)
        goto fail;
    size_t stride = (slot_bytes + POOL_PAGE - 1) & ~(size_t)(POOL_PAGE - 1);
    if (num_slots > UINT64_MAX / stride || num_slots * stride > (uint64_t)SIZE_MAX / 2)
        goto fail;

    p = tkv_xcalloc(1, sizeof(*p));
    p->fd = -1;
    p->ro_fd = -1;
    p->base = MAP_FAILED;
    p->slot_bytes = slot_bytes;
    p->slot_stride = stride;
    p->num_slots = num_slots;
    p->bytes = num_slots * stride;
    pthread_mutex_init(&p->mu, NULL);

    rc = TKV_EIO;
    p->fd = memfd_create(name ? name : "tierkv-l2", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (p->fd < 0) {
        TKV_LOG(TKV_LOG_ERROR, "memfd_create: %s", strerror(errno));
        goto fail;
    }
    if (ftruncate(p->fd, (off_t)p->bytes) != 0) {
        TKV_LOG(TKV_LOG_ERROR, "ftruncate memfd to %llu bytes: %s",
                (unsigned long long)p->bytes, strerror(errno));
        goto fail;
    }
    /* Sealed before anyone else can see the fd: a client's mapping can never lose its pages. */
    if (fcntl(p->fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
        TKV_LOG(TKV_LOG_ERROR, "sealing memfd: %s", strerror(errno));
        goto fail;
    }
    /* A client's descriptor must not allow a writable shared mapping: reopening the memfd
     * through /proc with O_RDONLY gives a file description mmap(PROT_WRITE, MAP_SHARED)
     * refuses. */
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", p->fd);
    p->ro_fd = open(path, O_RDONLY | O_CLOEXEC);
    if (p->ro_fd < 0) {
        TKV_LOG(TKV_LOG_ERROR, "read-only reopen of the pool memfd: %s", strerror(errno));
        goto fail;
    }
    /* MAP_POPULATE: the pool is memory the operator gave the cache, so take it now. A first
     * touch of a shmem page costs several times the copy into it (measured: put into a fresh
     * pool ran at ~1/5 the speed of a warm one), and the GPU tier registers the whole range
     * with the driver anyway. */
    p->base = mmap(NULL, p->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, p->fd, 0);
    if (p->base == MAP_FAILED) {
        TKV_LOG(TKV_LOG_ERROR, "mmap of %llu-byte pool: %s", (unsigned long long)p->bytes,
                strerror(errno));
        goto fail;
    }

    p->free_stack = tkv_xmalloc(num_slots * sizeof(uint32_t));
    p->used = tkv_xcalloc(num_slots, 1);
    /* Lowest slot on top, so a fresh pool hands out slots in address order. */
    for (uint64_t i = 0; i < num_slots; i++)
        p->free_stack[i] = (uint32_t)(num_slots - 1 - i);
    p->num_free = num_slots;
    *out = p;
    return TKV_OK;

fail:
    tkv_pool_destroy(p);
    if (out)
        *out = NULL;
    return rc;
}

void tkv_pool_destroy(tkv_pool *p)
{
    if (!p)
        return;
    if (p->base != MAP_FAILED)
        munmap(p->base, p->bytes);
    if (p->fd >= 0)
        close(p->fd);
    if (p->ro_fd >= 0)
        close(p->ro_fd);
    pthread_mutex_destroy(&p->mu);
    free(p->free_stack);
    free(p->used);
    free(p);
}

int tkv_pool_alloc(tkv_pool *p, size_t n, uint64_t *slots)
{
    pthread_mutex_lock(&p->mu);
    if (n > p->num_free) {
        pthread_mutex_unlock(&p->mu);
        return TKV_EFULL;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t s = p->free_stack[--p->num_free];
        TKV_ASSERT(!p->used[s]);
        p->used[s] = 1;
        slots[i] = s;
    }
    pthread_mutex_unlock(&p->mu);
    return TKV_OK;
}

void tkv_pool_free(tkv_pool *p, uint64_t slot)
{
    TKV_ASSERT(slot < p->num_slots);
    pthread_mutex_lock(&p->mu);
    TKV_ASSERT(p->used[slot]);
    TKV_ASSERT(p->num_free < p->num_slots);
    p->used[slot] = 0;
    p->free_stack[p->num_free++] = (uint32_t)slot;
    pthread_mutex_unlock(&p->mu);
}

uint64_t tkv_pool_num_slots(const tkv_pool *p) { return p->num_slots; }
size_t tkv_pool_slot_bytes(const tkv_pool *p) { return p->slot_bytes; }
size_t tkv_pool_slot_stride(const tkv_pool *p) { return p->slot_stride; }
int tkv_pool_fd(const tkv_pool *p) { return p->fd; }
int tkv_pool_fd_readonly(const tkv_pool *p) { return p->ro_fd; }
uint64_t tkv_pool_bytes(const tkv_pool *p) { return p->bytes; }
void *tkv_pool_base(const tkv_pool *p) { return p->base; }

uint64_t tkv_pool_num_free(tkv_pool *p)
{
    pthread_mutex_lock(&p->mu);
    uint64_t n = p->num_free;
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

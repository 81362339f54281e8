/* test_pool.c - the L2 pool: sealed memfd mappings (one per region), slot accounting that never
 * leaks, and regions whose descriptors show only their own slots. */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tkv_base.h"
#include "tkv_pool.h"

/* Counts used slots by asking the pool about every one. */
static uint64_t count_used(tkv_pool *p)
{
    uint64_t n = 0;
    for (uint64_t i = 0; i < tkv_pool_num_slots(p); i++)
        n += (uint64_t)tkv_pool_slot_used(p, i);
    return n;
}

START_TEST(create_validates_and_seals)
{
    tkv_pool *p = NULL;
    ck_assert_int_eq(tkv_pool_create("t", 0, 4, &p), TKV_EINVAL);
    ck_assert_int_eq(tkv_pool_create("t", 100, 0, &p), TKV_EINVAL);
    ck_assert_int_eq(tkv_pool_create("t", SIZE_MAX, 4, &p), TKV_EINVAL);
    ck_assert_int_eq(tkv_pool_create("t", 1 << 20, UINT64_MAX / 2, &p), TKV_EINVAL);
    ck_assert_ptr_null(p);

    ck_assert_int_eq(tkv_pool_create("tierkv-test", 5000, 8, &p), TKV_OK);
    ck_assert_uint_eq(tkv_pool_slot_bytes(p), 5000);
    ck_assert_uint_eq(tkv_pool_slot_stride(p), 8192); /* page aligned */
    ck_assert_uint_eq(tkv_pool_bytes(p), 8 * 8192);
    int fd = tkv_pool_fd(p);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(lseek(fd, 0, SEEK_END), 8 * 8192);
    int seals = fcntl(fd, F_GET_SEALS);
    ck_assert(seals & F_SEAL_GROW);
    ck_assert(seals & F_SEAL_SHRINK);
    ck_assert_int_ne(ftruncate(fd, 4096), 0);          /* cannot shrink under a client */
    ck_assert_int_ne(ftruncate(fd, 16 * 8192), 0);     /* nor grow */

    /* A second read-only mapping of the fd (what a client does) sees the slot bytes. */
    uint64_t s;
    ck_assert_int_eq(tkv_pool_alloc(p, 1, &s), TKV_OK);
    memset(tkv_pool_slot_ptr(p, s), 0xab, 5000);
    uint8_t *ro = mmap(NULL, tkv_pool_bytes(p), PROT_READ, MAP_SHARED, fd, 0);
    ck_assert_ptr_ne(ro, MAP_FAILED);
    ck_assert_uint_eq(ro[s * 8192 + 4999], 0xab);
    munmap(ro, tkv_pool_bytes(p));
    ck_assert_uint_eq(tkv_pool_slot_of_offset(p, s * 8192), s);
    ck_assert_uint_eq(tkv_pool_slot_of_offset(p, s * 8192 + 1), UINT64_MAX);
    ck_assert_uint_eq(tkv_pool_slot_of_offset(p, 8 * 8192), UINT64_MAX);
    tkv_pool_free(p, s);
    tkv_pool_destroy(p);
}
END_TEST

/* Clients get the read-only descriptor: it maps for reading and sees the daemon's writes, but
 * the kernel refuses a writable shared mapping of it. */
START_TEST(readonly_descriptor_refuses_writable_mapping)
{
    tkv_pool *p = NULL;
    ck_assert_int_eq(tkv_pool_create("test-ro", 4096, 4, &p), TKV_OK);
    int ro = tkv_pool_fd_readonly(p);
    ck_assert_int_ge(ro, 0);
    ck_assert_int_ne(ro, tkv_pool_fd(p));
    size_t bytes = tkv_pool_bytes(p);
    void *w = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ro, 0);
    ck_assert_msg(w == MAP_FAILED, "writable mapping of the read-only descriptor succeeded");
    const unsigned char *r = mmap(NULL, bytes, PROT_READ, MAP_SHARED, ro, 0);
    ck_assert(r != MAP_FAILED);
    memset(tkv_pool_slot_ptr(p, 1), 0xab, 4096);
    ck_assert_int_eq(r[4096], 0xab);
    munmap((void *)r, bytes);
    tkv_pool_destroy(p);
}
END_TEST

START_TEST(alloc_all_free_all)
{
    tkv_pool *p;
    const uint64_t n = 64;
    ck_assert_int_eq(tkv_pool_create("t", 4096, n, &p), TKV_OK);
    uint64_t slots[64], extra;
    ck_assert_int_eq(tkv_pool_alloc(p, 65, slots), TKV_EFULL); /* all or nothing */
    ck_assert_uint_eq(tkv_pool_num_free(p), n);
    ck_assert_int_eq(tkv_pool_alloc(p, 40, slots), TKV_OK);
    ck_assert_int_eq(tkv_pool_alloc(p, 24, slots + 40), TKV_OK);
    ck_assert_int_eq(tkv_pool_alloc(p, 1, &extra), TKV_EFULL);
    ck_assert_uint_eq(tkv_pool_num_free(p), 0);
    ck_assert_uint_eq(count_used(p), n);
    /* Every slot handed out exactly once. */
    uint8_t seen[64] = {0};
    for (int i = 0; i < 64; i++) {
        ck_assert_uint_lt(slots[i], n);
        ck_assert_uint_eq(seen[slots[i]], 0);
        seen[slots[i]] = 1;
    }
    for (int i = 0; i < 64; i++)
        tkv_pool_free(p, slots[i]);
    ck_assert_uint_eq(tkv_pool_num_free(p), n);
    ck_assert_uint_eq(count_used(p), 0);
    tkv_pool_destroy(p);
}
END_TEST

START_TEST(random_churn_stays_consistent)
{
    tkv_pool *p;
    const uint64_t n = 257;
    ck_assert_int_eq(tkv_pool_create("t", 100, n, &p), TKV_OK);
    uint64_t held[257];
    size_t num_held = 0;
    unsigned seed = 12345;
    for (int round = 0; round < 20000; round++) {
        seed = seed * 1103515245u + 12345u;
        size_t k = (seed >> 16) % 9;
        if ((seed >> 8) & 1) {
            int rc = tkv_pool_alloc(p, k, held + num_held);
            if (num_held + k <= n) {
                ck_assert_int_eq(rc, TKV_OK);
                num_held += k;
            } else {
                ck_assert_int_eq(rc, TKV_EFULL);
            }
        } else {
            for (size_t j = 0; j < k && num_held; j++) {
                size_t pick = (seed >> 4) % num_held;
                tkv_pool_free(p, held[pick]);
                held[pick] = held[--num_held];
            }
        }
        ck_assert_uint_eq(tkv_pool_num_free(p) + num_held, n);
    }
    ck_assert_uint_eq(count_used(p), num_held);
    while (num_held)
        tkv_pool_free(p, held[--num_held]);
    ck_assert_uint_eq(tkv_pool_num_free(p), n);
    tkv_pool_destroy(p);
}
END_TEST

#include <pthread.h>

static tkv_pool *g_pool;

static void *churn_thread(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    uint64_t mine[16];
    for (int i = 0; i < 5000; i++) {
        seed = seed * 1103515245u + 12345u;
        size_t k = 1 + (seed >> 16) % 16;
        if (tkv_pool_alloc(g_pool, k, mine) == TKV_OK) {
            for (size_t j = 0; j < k; j++)
                memset(tkv_pool_slot_ptr(g_pool, mine[j]), (int)(uintptr_t)arg, 64);
            for (size_t j = 0; j < k; j++) {
                uint8_t *b = tkv_pool_slot_ptr(g_pool, mine[j]);
                if (b[0] != (uint8_t)(uintptr_t)arg || b[63] != (uint8_t)(uintptr_t)arg)
                    return (void *)1; /* another thread got the same slot */
                tkv_pool_free(g_pool, mine[j]);
            }
        }
    }
    return NULL;
}

START_TEST(threads_never_share_a_slot)
{
    ck_assert_int_eq(tkv_pool_create("t", 64, 40, &g_pool), TKV_OK);
    pthread_t th[4];
    for (uintptr_t i = 0; i < 4; i++)
        pthread_create(&th[i], NULL, churn_thread, (void *)(i + 1));
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(th[i], &r);
        ck_assert_ptr_null(r);
    }
    ck_assert_uint_eq(tkv_pool_num_free(g_pool), 40);
    ck_assert_uint_eq(count_used(g_pool), 0);
    tkv_pool_destroy(g_pool);
}
END_TEST

/* Regions: slots numbered across the pool, allocation within one region only, and each
 * region's descriptor maps exactly its own slots (bytes written through the pool's mapping
 * at another region's slot are nowhere in it). */
START_TEST(regions_are_separate_files)
{
    tkv_pool *p = NULL;
    const uint64_t none[2] = {0, 0};
    ck_assert_int_eq(tkv_pool_create_regions("t", 4096, none, 2, &p), TKV_EINVAL);
    const uint64_t sizes[3] = {2, 0, 3};
    ck_assert_int_eq(tkv_pool_create_regions("tierkv-rt", 5000, sizes, 3, &p), TKV_OK);
    size_t stride = tkv_pool_slot_stride(p);
    ck_assert_uint_eq(tkv_pool_num_slots(p), 5);
    ck_assert_uint_eq(tkv_pool_num_regions(p), 3);
    ck_assert_uint_eq(tkv_pool_region_first(p, 2), 2);
    ck_assert_int_eq(tkv_pool_region_fd(p, 1), -1);
    ck_assert_int_ge(tkv_pool_region_fd_readonly(p, 2), 0);
    uint64_t slots[4];
    ck_assert_int_eq(tkv_pool_alloc_in(p, 0, 3, slots), TKV_EFULL); /* region 0 has 2 */
    ck_assert_int_eq(tkv_pool_alloc_in(p, 1, 1, slots), TKV_EFULL);
    ck_assert_int_eq(tkv_pool_alloc_in(p, 2, 3, slots), TKV_OK);
    for (int i = 0; i < 3; i++) {
        ck_assert_uint_eq(slots[i], 2 + (uint64_t)i);
        ck_assert_uint_eq(tkv_pool_region_of(p, slots[i]), 2);
    }
    ck_assert_uint_eq(tkv_pool_num_free_in(p, 2), 0);
    ck_assert_uint_eq(tkv_pool_num_free(p), 2);
    ck_assert_uint_eq(tkv_pool_region_of(p, 1), 0);
    /* Distinct bytes in every slot through the pool's one mapping. */
    for (uint64_t i = 0; i < 5; i++)
        memset(tkv_pool_slot_ptr(p, i), 0xA0 + (int)i, stride);
    for (unsigned r = 0; r < 3; r += 2) {
        int fd = tkv_pool_region_fd_readonly(p, r);
        struct stat st;
        ck_assert_int_eq(fstat(fd, &st), 0);
        ck_assert_uint_eq((uint64_t)st.st_size, tkv_pool_region_slots(p, r) * stride);
        uint8_t *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        ck_assert_ptr_ne(m, MAP_FAILED);
        for (off_t b = 0; b < st.st_size; b++) {
            uint64_t slot = tkv_pool_region_first(p, r) + (uint64_t)b / stride;
            ck_assert_uint_eq(m[b], 0xA0 + slot);
        }
        munmap(m, (size_t)st.st_size);
    }
    tkv_pool_free(p, 3);
    ck_assert_uint_eq(tkv_pool_num_free_in(p, 2), 1);
    ck_assert_uint_eq(tkv_pool_num_free_in(p, 0), 2);
    ck_assert_int_eq(tkv_pool_alloc_in(p, 2, 1, slots), TKV_OK);
    ck_assert_uint_eq(slots[0], 3);
    tkv_pool_destroy(p);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("pool");
    TCase *tc = tcase_create("pool");
    tcase_add_test(tc, create_validates_and_seals);
    tcase_add_test(tc, readonly_descriptor_refuses_writable_mapping);
    tcase_add_test(tc, alloc_all_free_all);
    tcase_add_test(tc, random_churn_stays_consistent);
    tcase_add_test(tc, threads_never_share_a_slot);
    tcase_add_test(tc, regions_are_separate_files);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

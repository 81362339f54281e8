/* test_index.c - key table, chain structure (parents, orphans, adoption), prefix probe,
 * lease table; plus the store's locking discipline over the index from several threads. */
#include <check.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tkv_base.h"
#include "tkv_index.h"

/* Key i of chain c: first 8 bytes spread (they are the table's tag), the rest name (c, i). */
static tkv_key mk(uint32_t c, uint32_t i)
{
    tkv_key k;
    memset(&k, 0, sizeof(k));
    uint64_t x = ((uint64_t)c << 32 | i) * 0x9E3779B97F4A7C15ull + 1;
    memcpy(k.b, &x, 8);
    memcpy(k.b + 8, &c, 4);
    memcpy(k.b + 12, &i, 4);
    k.b[31] = 1; /* never the all-zero "root" key */
    return k;
}

/* Keys that collide on the tag (first 8 bytes) but differ elsewhere. */
static tkv_key mk_collide(uint32_t i)
{
    tkv_key k;
    memset(&k, 0x5a, sizeof(k));
    memcpy(k.b + 16, &i, 4);
    return k;
}

static tkv_entry *add(tkv_index *ix, uint32_t c, uint32_t i)
{
    tkv_key k = mk(c, i), p = mk(c, i - 1);
    static const tkv_key zero;
    tkv_entry *e = tkv_entry_new(&k, i ? &p : &zero, 0);
    ck_assert_int_eq(tkv_index_insert(ix, e), TKV_OK);
    return e;
}

START_TEST(insert_find_remove_many)
{
    tkv_index *ix = tkv_index_new(4); /* grows */
    const uint32_t n = 20000;
    for (uint32_t i = 0; i < n; i++)
        add(ix, i % 7, i);
    ck_assert_uint_eq(tkv_index_count(ix), n);
    for (uint32_t i = 0; i < n; i++) {
        tkv_key k = mk(i % 7, i);
        tkv_entry *e = tkv_index_find(ix, &k);
        ck_assert_ptr_nonnull(e);
        ck_assert_mem_eq(&e->key, &k, sizeof(k));
    }
    tkv_key absent = mk(99, 1);
    ck_assert_ptr_null(tkv_index_find(ix, &absent));
    /* Duplicate insert refused. */
    tkv_key k0 = mk(0, 0);
    tkv_entry *dup = tkv_entry_new(&k0, NULL, 0);
    ck_assert_int_eq(tkv_index_insert(ix, dup), TKV_EEXIST);
    tkv_entry_free(dup);
    /* Remove every other; the rest stay findable (backward-shift deletion keeps runs intact). */
    for (uint32_t i = 0; i < n; i += 2) {
        tkv_key k = mk(i % 7, i);
        tkv_entry *e = tkv_index_find(ix, &k);
        tkv_index_remove(ix, e);
        tkv_entry_free(e);
    }
    ck_assert_uint_eq(tkv_index_count(ix), n / 2);
    for (uint32_t i = 0; i < n; i++) {
        tkv_key k = mk(i % 7, i);
        if (i % 2)
            ck_assert_ptr_nonnull(tkv_index_find(ix, &k));
        else
            ck_assert_ptr_null(tkv_index_find(ix, &k));
    }
    tkv_index_free(ix); /* frees the remaining entries (LeakSanitizer checks) */
}
END_TEST

START_TEST(tag_collisions)
{
    tkv_index *ix = tkv_index_new(16);
    tkv_entry *es[100];
    for (uint32_t i = 0; i < 100; i++) {
        tkv_key k = mk_collide(i);
        es[i] = tkv_entry_new(&k, NULL, 0);
        ck_assert_int_eq(tkv_index_insert(ix, es[i]), TKV_OK);
    }
    for (uint32_t i = 0; i < 100; i += 3) {
        tkv_index_remove(ix, es[i]);
        tkv_entry_free(es[i]);
    }
    for (uint32_t i = 0; i < 100; i++) {
        tkv_key k = mk_collide(i);
        tkv_entry *e = tkv_index_find(ix, &k);
        if (i % 3 == 0)
            ck_assert_ptr_null(e);
        else
            ck_assert_ptr_eq(e, es[i]);
    }
    tkv_index_free(ix);
}
END_TEST

static uint32_t num_children(const tkv_entry *e)
{
    uint32_t n = 0;
    for (tkv_entry *c = e->first_child; c; c = c->next_sibling)
        n++;
    return n;
}

START_TEST(chain_links_orphans_and_adoption)
{
    tkv_index *ix = tkv_index_new(16);
    /* Insert a chain of 6 in scrambled order (as an L3 scan in key order would). */
    uint32_t order[6] = {4, 1, 5, 0, 3, 2};
    tkv_entry *e[6];
    for (int j = 0; j < 6; j++)
        e[order[j]] = add(ix, 1, order[j]);
    for (int i = 1; i < 6; i++) {
        ck_assert_ptr_eq(e[i]->parent, e[i - 1]);
        ck_assert_uint_eq(num_children(e[i - 1]), 1);
    }
    ck_assert_ptr_null(e[0]->parent);
    ck_assert_uint_eq(e[1]->depth, 1);

    /* A branch: a second child of block 2. */
    tkv_key bk = mk(2, 77), p2 = e[2]->key;
    tkv_entry *b = tkv_entry_new(&bk, &p2, 0);
    ck_assert_int_eq(tkv_index_insert(ix, b), TKV_OK);
    ck_assert_ptr_eq(b->parent, e[2]);
    ck_assert_uint_eq(b->depth, e[2]->depth + 1);
    ck_assert_uint_eq(num_children(e[2]), 2);

    /* Remove block 2: its children become orphans; re-inserting it adopts them again. */
    tkv_index_remove(ix, e[2]);
    ck_assert_ptr_null(e[3]->parent);
    ck_assert_ptr_null(b->parent);
    ck_assert_uint_eq(num_children(e[1]), 0);
    tkv_entry_free(e[2]);
    e[2] = add(ix, 1, 2);
    ck_assert_ptr_eq(e[2]->parent, e[1]);
    ck_assert_ptr_eq(e[3]->parent, e[2]);
    ck_assert_ptr_eq(b->parent, e[2]);
    ck_assert_uint_eq(num_children(e[2]), 2);

    /* Prefix probe stops at the first key not indexed. */
    tkv_key q[8];
    for (int i = 0; i < 8; i++)
        q[i] = mk(1, (uint32_t)i);
    tkv_entry *out[8];
    ck_assert_uint_eq(tkv_index_prefix(ix, q, 8, out), 6);
    for (int i = 0; i < 6; i++)
        ck_assert_ptr_eq(out[i], e[i]);
    tkv_index_remove(ix, e[4]);
    tkv_entry_free(e[4]);
    ck_assert_uint_eq(tkv_index_prefix(ix, q, 8, out), 4);
    tkv_index_free(ix);
}
END_TEST

START_TEST(lease_table)
{
    tkv_lease_table *t = tkv_lease_table_new();
    tkv_key k = mk(0, 0);
    tkv_entry *e = tkv_entry_new(&k, NULL, 0);
    tkv_entry *ents[3] = {e, e, e};
    uint64_t ids[1000];
    for (int i = 0; i < 1000; i++) {
        tkv_lease *l = tkv_lease_add(t, (uint64_t)(i % 10), 1000 + (uint64_t)i, ents, 3);
        ids[i] = l->id;
        ck_assert_uint_eq(l->num_entries, 3);
        if (i)
            ck_assert_uint_gt(ids[i], ids[i - 1]);
    }
    ck_assert_uint_eq(tkv_lease_count(t), 1000);
    for (int i = 0; i < 1000; i++)
        ck_assert_uint_eq(tkv_lease_get(t, ids[i])->owner, (uint64_t)(i % 10));
    ck_assert_ptr_null(tkv_lease_get(t, 0));
    ck_assert_ptr_null(tkv_lease_get(t, ids[999] + 1));
    tkv_lease *l = tkv_lease_get(t, ids[5]);
    tkv_lease_mark_expired(t, l, 42);
    ck_assert_uint_eq(tkv_lease_count(t), 999);
    ck_assert_ptr_eq(tkv_lease_get(t, ids[5]), l); /* record kept for TKV_EXPIRED */
    ck_assert_uint_eq(l->num_entries, 0);
    tkv_lease_del(t, l);
    ck_assert_ptr_null(tkv_lease_get(t, ids[5]));
    ck_assert_uint_eq(tkv_lease_count(t), 999);
    tkv_lease_del(t, tkv_lease_get(t, ids[6]));
    ck_assert_uint_eq(tkv_lease_count(t), 998);
    tkv_lease_table_free(t);
    tkv_entry_free(e);
}
END_TEST

/* The store's discipline: probes under the read lock, inserts/removes under the write lock.
 * Readers must always find the stable chain; writers churn other keys. */
static tkv_index *g_ix;
static pthread_rwlock_t g_lock = PTHREAD_RWLOCK_INITIALIZER;

static void *reader(void *arg)
{
    tkv_key q[64];
    tkv_entry *out[64];
    for (int i = 0; i < 64; i++)
        q[i] = mk(0, (uint32_t)i);
    for (int r = 0; r < 20000; r++) {
        pthread_rwlock_rdlock(&g_lock);
        size_t n = tkv_index_prefix(g_ix, q, 64, out);
        pthread_rwlock_unlock(&g_lock);
        if (n != 64)
            return (void *)1;
    }
    return NULL;
}

static void *writer(void *arg)
{
    uint32_t c = (uint32_t)(uintptr_t)arg;
    for (uint32_t r = 0; r < 3000; r++) {
        tkv_key k = mk(c, r), p = mk(c, r - 1);
        tkv_entry *e = tkv_entry_new(&k, &p, 0);
        pthread_rwlock_wrlock(&g_lock);
        int rc = tkv_index_insert(g_ix, e);
        if (r >= 8) { /* keep a window of 8 per writer */
            tkv_key old = mk(c, r - 8);
            tkv_entry *o = tkv_index_find(g_ix, &old);
            tkv_index_remove(g_ix, o);
            tkv_entry_free(o);
        }
        pthread_rwlock_unlock(&g_lock);
        if (rc != TKV_OK)
            return (void *)1;
    }
    return NULL;
}

START_TEST(concurrent_readers_and_writers)
{
    g_ix = tkv_index_new(16);
    for (uint32_t i = 0; i < 64; i++)
        add(g_ix, 0, i);
    pthread_t th[4];
    pthread_create(&th[0], NULL, reader, NULL);
    pthread_create(&th[1], NULL, reader, NULL);
    pthread_create(&th[2], NULL, writer, (void *)(uintptr_t)5);
    pthread_create(&th[3], NULL, writer, (void *)(uintptr_t)6);
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(th[i], &r);
        ck_assert_ptr_null(r);
    }
    ck_assert_uint_eq(tkv_index_count(g_ix), 64 + 2 * 8);
    tkv_index_free(g_ix);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("index");
    TCase *tc = tcase_create("index");
    tcase_add_test(tc, insert_find_remove_many);
    tcase_add_test(tc, tag_collisions);
    tcase_add_test(tc, chain_links_orphans_and_adoption);
    tcase_add_test(tc, lease_table);
    tcase_add_test(tc, concurrent_readers_and_writers);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

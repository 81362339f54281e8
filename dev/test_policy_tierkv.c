/* test_policy_tierkv.c - "tierkv" (dev/policy_tierkv.c): invariants under a random workload
 * with leases, pinned blocks never evicted, O(1) behaviour at scale, and its own rules (hit
 * blocks outlive fresh ones, a dead branch goes first, a whole dead suffix goes before a live
 * chain, first turns are held when their next turns come late and not when they come early,
 * the dead ends of puts are stripped from waiting first turns, returning blocks and
 * conversations are recognised by the ghost history) and a synthetic workload on which it
 * must beat LRU. The manager and the workloads are tests/storage/policy_harness.h's. */
#include "policy_harness.h"
#include "tkv_policy_dev.h"

static const tkv_policy_ops *const project[] = {&tkv_policy_tierkv};

/* ============================================================================================
 * Invariants under a random workload
 * ========================================================================================== */

START_TEST(registered)
{
    ck_assert_ptr_null(tkv_policy_find("tierkv")); /* not the store's: dev/ only */
    ck_assert_ptr_null(tkv_policy_tierkv.create(0));
}
END_TEST

START_TEST(random_invariants) { random_invariants_of(project[_i]); }
END_TEST

START_TEST(pinned_never_evicted) { pinned_never_evicted_of(project[_i]); }
END_TEST

/* ============================================================================================
 * The policy's own rules
 * ========================================================================================== */

/* A block hit a few times outlives blocks inserted after its last hit but never hit. */
START_TEST(hits_buy_life)
{
    mgr *m = mgr_new(&tkv_policy_tierkv, 64, 32);
    for (int i = 0; i < 64; i++)
        mgr_link(m, i, -1);
    ck_assert(mgr_insert(m, 0, true));
    for (int k = 0; k < 3; k++)
        mgr_request(m, 0, true); /* block 0: three hits */
    for (int i = 1; i < 8; i++)
        ck_assert(mgr_insert(m, i, true));
    /* 8 fresh blocks arrive: LRU would evict 0 first; here 1..7 go before it */
    for (int k = 0; k < 7; k++) {
        int v = mgr_victim(m, true);
        ck_assert_int_ne(v, 0);
        mgr_remove(m, v);
    }
    ck_assert_int_eq(mgr_victim(m, true), 0);
    mgr_remove(m, 0);
    mgr_free(m);
}
END_TEST

/* A chain a -> b -> c (c the never-hit end of a request); the next request hits a, b and goes
 * on with d under b: c is dead and is the first victim, although it is newer than the
 * unrelated chain x. */
START_TEST(dead_branch_first)
{
    enum { A, B, C, D, X };
    mgr *m = mgr_new(&tkv_policy_tierkv, 5, 100);
    mgr_link(m, X, -1);
    mgr_link(m, A, -1);
    mgr_link(m, B, A);
    mgr_link(m, C, B);
    mgr_link(m, D, B);
    ck_assert(mgr_insert(m, X, true));
    mgr_request(m, C, true);
    mgr_request(m, D, true);
    ck_assert_int_eq(mgr_victim(m, true), C);
    mgr_remove(m, C);
    /* then by priority: x is the coldest tail (a, b were hit; d is newer) */
    ck_assert_int_eq(mgr_victim(m, true), X);
    mgr_free(m);
}
END_TEST

/* The branch a hub's other children start is not dead: a root with many children (a shared
 * system prompt) does not condemn its earlier branches. */
START_TEST(hub_branches_not_dead)
{
    mgr *m = mgr_new(&tkv_policy_tierkv, 6, 100);
    mgr_link(m, 0, -1);
    for (int i = 1; i < 6; i++)
        mgr_link(m, i, 0);
    for (int i = 1; i < 6; i++)
        mgr_request(m, i, true);
    /* branches 1..4 were followed by a new branch under the same parent; only the first
     * sibling pair (0 had one child) qualifies as "extended in a new direction" */
    int v = mgr_victim(m, true);
    ck_assert_int_eq(v, 1);
    mgr_remove(m, v);
    ck_assert_int_eq(mgr_victim(m, true), 2); /* then plain order: oldest tail */
    mgr_free(m);
}
END_TEST

/* When a chain's tail is evicted, the rest of the dead chain follows before a chain that was
 * touched later: whole dead suffixes go first. */
START_TEST(dead_suffix_as_a_whole)
{
    mgr *m = mgr_new(&tkv_policy_tierkv, 10, 100);
    for (int i = 0; i < 5; i++)
        mgr_link(m, i, i - 1);
    for (int i = 5; i < 10; i++)
        mgr_link(m, i, i == 5 ? -1 : i - 1);
    mgr_request(m, 4, true); /* old chain 0..4 */
    mgr_request(m, 9, true); /* newer chain 5..9 */
    for (int k = 4; k >= 0; k--) {
        int v = mgr_victim(m, true);
        ck_assert_int_eq(v, k);
        mgr_remove(m, v);
    }
    ck_assert_int_eq(mgr_victim(m, true), 9);
    mgr_free(m);
}
END_TEST

/* 1,000,000 block operations on a tier of 50,000 blocks, without and with keys (harness). */
START_TEST(million_ops) { million_ops_of(project[_i / 2], _i % 2); }
END_TEST

/* Second turns arrive 100..600 requests later; the tier (4 blocks turned over per request)
 * remembers ~100 requests, so LRU sees almost no return. Returns grow likelier with age at
 * the horizon; the policy learns that an old first turn earns more than a newcomer, holds
 * first turns longer and refuses newcomers. Measured: lru 0.19%, tierkv 1.78% (25% is
 * reachable); with keys (rule 5) 3.46%. The loop runs it without and with keys. */
START_TEST(late_turns_held)
{
    double lru = turns_hit_rate(&tkv_policy_lru, 100, 600, false);
    double tierkv = turns_hit_rate(&tkv_policy_tierkv, 100, 600, _i);
    fprintf(stderr, "late second turns: lru %.2f%%, tierkv %.2f%% (keys %d)\n", 100 * lru,
            100 * tierkv, _i);
    ck_assert_msg(tierkv > lru * 5 && tierkv > lru + 0.01,
                  "tierkv %.4f does not clearly beat lru %.4f on late turns", tierkv, lru);
}
END_TEST

/* Second turns arrive 1..100 requests later, inside LRU's horizon (~130 requests here): the
 * rule must not turn away first turns that would come back in time (turning every newcomer
 * away would hit almost none). LRU hits all of them (24.96%); tierkv 23.43%, because rule 1
 * gives the second turns' hit blocks, never used again here, extra life (24.16% without
 * rule 3); with keys (rule 5) 23.77%. */
START_TEST(early_turns_not_held)
{
    double lru = turns_hit_rate(&tkv_policy_lru, 1, 100, false);
    double tierkv = turns_hit_rate(&tkv_policy_tierkv, 1, 100, _i);
    fprintf(stderr, "early second turns: lru %.2f%%, tierkv %.2f%% (keys %d)\n", 100 * lru,
            100 * tierkv, _i);
    ck_assert_msg(tierkv > 0.9 * lru, "tierkv %.4f far below lru %.4f on early turns", tierkv,
                  lru);
}
END_TEST

START_TEST(put_ends_go_first)
{
    uint64_t lru_hits, tierkv_hits;
    double lru = ends_kept(&tkv_policy_lru, 1, &lru_hits);
    double tierkv = ends_kept(&tkv_policy_tierkv, 1, &tierkv_hits);
    fprintf(stderr, "waiting first turns with their dead end: lru %.2f, tierkv %.2f (hits %llu, "
            "%llu)\n", lru, tierkv, (unsigned long long)lru_hits, (unsigned long long)tierkv_hits);
    ck_assert_msg(lru > 0.9, "lru keeps the end of only %.2f of first turns", lru);
    ck_assert_msg(tierkv < 0.5, "tierkv keeps the dead end of %.2f of first turns", tierkv);
    ck_assert_msg(tierkv_hits > lru_hits, "tierkv %llu hits, lru %llu",
                  (unsigned long long)tierkv_hits, (unsigned long long)lru_hits);
}
END_TEST

/* ============================================================================================
 * Rule 5: ghost history (with key fingerprints)
 * ========================================================================================== */

/* Single-block chains through a tier of 8: block 0 is evicted, then comes back. With keys it
 * was seen before and enters as hit once, so it outlives a fresh block inserted after it;
 * without keys it is a fresh block again and goes first. */
START_TEST(returning_block_earns_life)
{
    for (int keys = 0; keys <= 1; keys++) {
        mgr *m = mgr_new(&tkv_policy_tierkv, 20, 8);
        m->keys = keys;
        for (int i = 0; i < 20; i++)
            mgr_link(m, i, -1);
        for (int i = 0; i <= 8; i++)
            mgr_request(m, i, true); /* 8 evicts 0, the oldest */
        ck_assert(!m->nodes[0].present);
        mgr_request(m, 0, true); /* back: evicts 1 */
        ck_assert(m->nodes[0].present && !m->nodes[1].present);
        for (int i = 9; i <= 15; i++)
            mgr_request(m, i, true); /* evict 2..8, all older than 0's return */
        for (int i = 2; i <= 8; i++)
            ck_assert(!m->nodes[i].present);
        mgr_request(m, 16, true);
        ck_assert_msg(m->nodes[0].present == (keys != 0), "keys %d: block 0 %s", keys,
                      m->nodes[0].present ? "kept" : "evicted");
        ck_assert(m->nodes[9].present == !keys);
        mgr_free(m);
    }
}
END_TEST

/* Gaps around the tier's horizon (~100 requests) and beyond it: a turn whose previous turn
 * was evicted or refused comes back. With keys it is recognised (its blocks enter as hit, and
 * rule 3 judges it by what returning blocks earn, here a 1/2 chance of another turn), so the
 * next turn finds it. Measured (lru, tierkv, tierkv with keys): 50..150 6.06, 14.90, 15.28;
 * 100..300 0.21, 5.99, 7.00; 100..600 0.20, 0.52, 2.40; 300..900 0.07, 0.07, 0.05; 1..100
 * (inside the horizon, where rule 1's extra life for hit blocks costs) 30.88, 26.47, 25.70. */
START_TEST(returning_conversations)
{
    static const int gaps[][3] = {/* lo, hi, must gain */
                                  {50, 150, 0}, {100, 300, 1}, {100, 600, 1}, {300, 900, 0},
                                  {1, 100, 0}};
    for (size_t g = 0; g < sizeof(gaps) / sizeof(gaps[0]); g++) {
        double lru = convs_hit_rate(&tkv_policy_lru, false, gaps[g][0], gaps[g][1]);
        double plain = convs_hit_rate(&tkv_policy_tierkv, false, gaps[g][0], gaps[g][1]);
        double keys = convs_hit_rate(&tkv_policy_tierkv, true, gaps[g][0], gaps[g][1]);
        fprintf(stderr, "conversations, gaps %d..%d: lru %.2f%%, tierkv %.2f%%, with keys "
                "%.2f%%\n", gaps[g][0], gaps[g][1], 100 * lru, 100 * plain, 100 * keys);
        if (gaps[g][2])
            ck_assert_msg(keys > plain + 0.005, "gaps %d..%d: keys %.4f, without %.4f",
                          gaps[g][0], gaps[g][1], keys, plain);
        else
            ck_assert_msg(keys > 0.95 * plain - 0.001, "gaps %d..%d: keys %.4f, without %.4f",
                          gaps[g][0], gaps[g][1], keys, plain);
    }
}
END_TEST


START_TEST(beats_lru_on_synthetic)
{
    double lru = synthetic_hit_rate(&tkv_policy_lru);
    double tierkv = synthetic_hit_rate(&tkv_policy_tierkv);
    fprintf(stderr, "synthetic prefix workload: lru %.2f%%, tierkv %.2f%%\n", 100 * lru,
            100 * tierkv);
    /* measured: lru 3.09%, tierkv 4.42% of 7.8% reachable; deterministic */
    ck_assert_msg(tierkv > lru * 1.2 && tierkv > lru + 0.005,
                  "tierkv %.4f does not clearly beat lru %.4f", tierkv, lru);
}
END_TEST


int main(void)
{
    Suite *s = suite_create("policy_tierkv");
    TCase *inv = tcase_create("invariants");
    tcase_add_test(inv, registered);
    tcase_add_loop_test(inv, random_invariants, 0, 1);
    tcase_add_loop_test(inv, pinned_never_evicted, 0, 1);
    suite_add_tcase(s, inv);
    TCase *rules = tcase_create("rules");
    tcase_add_test(rules, hits_buy_life);
    tcase_add_test(rules, dead_branch_first);
    tcase_add_test(rules, hub_branches_not_dead);
    tcase_add_test(rules, dead_suffix_as_a_whole);
    tcase_add_loop_test(rules, late_turns_held, 0, 2); /* without and with keys */
    tcase_add_loop_test(rules, early_turns_not_held, 0, 2);
    tcase_add_test(rules, put_ends_go_first);
    tcase_add_test(rules, returning_block_earns_life);
    tcase_add_test(rules, returning_conversations);
    suite_add_tcase(s, rules);
    TCase *scale = tcase_create("scale");
    tcase_set_timeout(scale, 120);
    tcase_add_loop_test(scale, million_ops, 0, 2); /* without and with keys */
    suite_add_tcase(s, scale);
    TCase *synth = tcase_create("synthetic");
    tcase_set_timeout(synth, 120);
    tcase_add_test(synth, beats_lru_on_synthetic);
    suite_add_tcase(s, synth);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}


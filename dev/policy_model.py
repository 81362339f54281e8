#!/usr/bin/env python3
"""policy_model.py - a model of the tier manager for trying cache policies on a Mooncake trace.

Not the store: one cache entry per 512-token trace block, chain tails evicted first, the blocks
of the request being served pinned, a request's missing blocks put in chain order (a block whose
parent is not cached is not put). LRU here gives the same hit rates as bench/trace_replay's LRU
(21.16% of blocks at 10,000 blocks on the conversation trace). It exists to measure what a policy
could reach before building it in C (the upper bounds that docs/perf.md's policy section quotes):

  lru           exact LRU among unpinned tails.
  index-true    hazard index with each class's true reuse hazard by age, taken from the whole
                trace (the future): a ceiling, not a policy. Age in requests; classes from
                features known with unlimited memory. Needs numpy.
  index-online  the same rule learned online: age in ticks (one per block inserted, hit or
                refused), classes from what the cache and a ghost history of departed blocks
                remember, hazards from reuse counts over exposure (see learn()).
  index-past    index-true's classes and ages, but each class's hazard re-estimated every
                `--every` requests from the past alone (every use before then, its next use
                seen if it came before then, else censored there; Kaplan-Meier): what perfect
                observation of the past, with unlimited memory, tells. Needs numpy.

`--from M` counts hits from request M on only (the requests before it still run), to tell a
warm-up from the steady state.

The hazard index of a block of class c at age a is the most hits per tick of holding it that
any holding time T can give: max over T of P(reused within T) / E[min(time to reuse, T)]. The
policy evicts the lowest index among `--samples` random unpinned tails, and refuses the rest of
a put whose first block's index at age 0 is below that victim's.

  dev/policy_model.py --trace FILE --capacity 5000,10000 --policy lru,index-online
"""
import argparse
import collections
import heapq
import json
import math
import random

FEATURES = "u l t n r".split()  # prior uses, last block, turn, new blocks, request length


def bucket_new(x):
    return 0 if x <= 4 else 1 if x <= 8 else 2 if x <= 16 else 3 if x <= 64 else 4


def class_key(uses, last, turn, new, length, keys):
    f = dict(u=min(uses, 4), l=last, t=min(turn, 5), n=bucket_new(new), r=bucket_new(length))
    return tuple(f[k] for k in keys)


def index_row(hz):
    """Hazard index by age from per-bucket hazards hz[a] (P(reuse in bucket a | not before)):
    max over T of P(reused in [a, a + T)) / E[buckets held]. With S the survival, that is the
    largest slope from point a to a later one of the points (G_i, F_i) = (sum of S below i,
    1 - S_i): a tangent to the upper hull of the later points, kept on a stack in one backward
    pass (storage/policy_hazard.c's build_index). G differences are taken from suffix sums, whose
    terms are all below S_i, so that they keep their precision where S falls by many orders of
    magnitude; a hazard of 1 is taken as 1 - 1e-9, so that the ages after it keep a survival
    (and their index, conditional on reaching them); a span whose survival underflowed has
    slope 0."""
    nb = len(hz)
    S = [1.0] * (nb + 1)
    for a in range(nb):
        S[a + 1] = S[a] * (1 - min(hz[a], 1 - 1e-9))
    R = [0.0] * (nb + 1)  # R[i] = sum of S[i:nb]
    for a in range(nb - 1, -1, -1):
        R[a] = R[a + 1] + S[a]

    def slope(i, j):
        den = R[i] - R[j]
        return (S[i] - S[j]) / den if den > 0 else 0.0

    out, stack = [0.0] * nb, [nb]
    for a in range(nb - 1, -1, -1):
        while len(stack) >= 2 and slope(a, stack[-1]) <= slope(a, stack[-2]):
            stack.pop()
        out[a] = slope(a, stack[-1])
        stack.append(a)
    return out


class Classes:
    def __init__(self):
        self.ids = {}

    def id(self, key):
        return self.ids.setdefault(key, len(self.ids))


class Learner:
    """Online hazards per class by age bucket: reuses seen at age a over the ticks that blocks of
    the class spent at age a, whether still cached, departed (remembered by the ghost history)
    or reused since. Counting exposure of the blocks still held avoids the bias of counting
    only finished stays, which over-weights short ones. Hazard = a base rate by age shared by
    the classes of the same prior-use count, times the class's own reuse/expected ratio
    (proportional hazards: the base has the data for the age profile, the ratio needs only a
    class total)."""

    def __init__(self, capacity, classes, keys, nb=64, per_fill=8, decay=1 / 64, refresh=16,
                 prior=20):
        self.nb, self.bw = nb, max(1, capacity // per_fill)
        self.decay, self.every, self.prior = decay, max(1, capacity // refresh), prior
        self.classes, self.ukey = classes, keys.index("u") if "u" in keys else None
        self.reuse = collections.defaultdict(lambda: [0.0] * nb)
        self.expo = collections.defaultdict(lambda: [0.0] * nb)
        self.open = collections.defaultdict(lambda: [0] * nb)  # by start bucket (ring)
        self.old = collections.Counter()
        self.ix = {}
        self.tick = self.cur = 0

    def start(self, c):
        self.open[c][self.cur % self.nb] += 1

    def end(self, c, start_tick, reused):
        a = self.cur - start_tick // self.bw
        if a >= self.nb - 1:
            self.old[c] -= 1
            a = self.nb - 1
        else:
            self.open[c][(start_tick // self.bw) % self.nb] -= 1
        if reused:
            self.reuse[c][a] += 1

    def advance(self):
        self.tick += 1
        if self.tick % self.bw == 0:
            for c, o in self.open.items():
                ex = self.expo[c]
                for a in range(self.nb - 1):
                    ex[a] += o[(self.cur - a) % self.nb]
                ex[self.nb - 1] += self.old[c]
            self.cur += 1
            slot = (self.cur - (self.nb - 1)) % self.nb
            for c, o in self.open.items():
                self.old[c] += o[slot]
                o[slot] = 0
        if self.tick % self.every == 0:
            self.learn()

    def learn(self):
        key_of = {cid: k for k, cid in self.classes.ids.items()}
        groups = collections.defaultdict(list)
        for c in self.expo:
            groups[key_of[c][self.ukey] if self.ukey is not None else 0].append(c)
        for cs in groups.values():
            base = []
            for a in range(self.nb):
                r = sum(self.reuse[c][a] for c in cs)
                e = sum(self.expo[c][a] for c in cs)
                base.append(r / e if e > 0 else 0.0)
            for c in cs:
                expected = sum(x * b for x, b in zip(self.expo[c], base))
                m = (sum(self.reuse[c]) + self.prior) / (expected + self.prior)
                self.ix[c] = index_row([min(1.0, b * m) for b in base])
        for c in self.expo:
            for a in range(self.nb):
                self.reuse[c][a] *= 1 - self.decay
                self.expo[c][a] *= 1 - self.decay

    def value(self, c, start_tick):
        row = self.ix.get(c)
        return row[min((self.tick - start_tick) // self.bw, self.nb - 1)] if row else 1.0


def trace_uses(reqs, classes, keys):
    """Every block use of the trace: its class (features known with unlimited memory) by
    [request][position], and flat numpy arrays over all uses of class, request and the
    request of the block's next use (-1: none), for hazard_table()."""
    import numpy as np

    seen, inserter, turn, uses = set(), {}, [], collections.Counter()
    cls, nxt, last = [], [], {}
    for i, h in enumerate(reqs):
        k = 0
        while k < len(h) and h[k] in seen:
            k += 1
        turn.append(1 if k < 2 else turn[inserter[h[k - 1]]] + 1)
        for b in h[k:]:
            seen.add(b)
            inserter.setdefault(b, i)
        row = []
        for j, b in enumerate(h):
            uses[b] += 1
            key = class_key(uses[b], int(j == len(h) - 1), turn[i], len(h) - k, len(h), keys)
            row.append(classes.id(key))
        cls.append(row)
        nxt.append([-1] * len(h))
    for i in range(len(reqs) - 1, -1, -1):
        for j, b in enumerate(reqs[i]):
            nxt[i][j] = last.get(b, -1)
            last[b] = i
    arrays = (np.array([c for row in cls for c in row]),
              np.array([i for i, row in enumerate(cls) for _ in row]),
              np.array([x for row in nxt for x in row]))
    return cls, arrays


def hazard_table(arrays, num_classes, width, nb, t=None):
    """Per class, the index by age (buckets of `width` requests, the last for every older age)
    from the Kaplan-Meier hazard of the next use of the uses before request t, a next use at
    or after t censored at t (index-past); t = None: every use of the trace, next uses known
    (index-true: a use never used again is at risk through the last bucket)."""
    import numpy as np

    if t is None:
        t = 1 << 40  # past every request: every next use seen, the rest open to the last bucket
    m = arrays[1] < t
    c, s, x = (a[m] for a in arrays)
    seen = (x >= 0) & (x < t)
    b = np.minimum(np.where(seen, x - s, t - s) // width, nb)
    reused = np.zeros((num_classes, nb + 1))
    np.add.at(reused, (c[seen], b[seen]), 1)
    ended = np.zeros((num_classes, nb + 1))
    np.add.at(ended, (c, b), 1)
    at_risk = np.cumsum(ended[:, ::-1], axis=1)[:, ::-1]  # uses still open at age bucket a
    hz = reused / np.maximum(at_risk, 1)
    return np.array([index_row(list(row)) if row.any() else [0.0] * (nb + 1) for row in hz])


def replay(reqs, capacity, policy, keys, samples, seed=1, first=0, width=8, every=200):
    rnd = random.Random(seed)
    classes = Classes()
    nb = 9600 // width  # ages of the true and past tables: up to 9,600 requests
    if policy in ("index-true", "index-past"):
        true_cls, trace_arrays = trace_uses(reqs, classes, keys)
        seen_until = 0 if policy == "index-past" else None  # nothing yet: recency decides
        table = hazard_table(trace_arrays, len(classes.ids), width, nb, seen_until)
    learner = Learner(capacity, classes, keys) if policy == "index-online" else None
    cached = {}  # block -> [start tick, request, class, children, parent, uses, turn]
    # departed or refused blocks: block -> (start tick, class, uses, turn)
    ghost = collections.OrderedDict()
    tails, tpos, heap = [], {}, []
    tick = 0

    def add_tail(b):
        tpos[b] = len(tails)
        tails.append(b)
        heapq.heappush(heap, (cached[b][0], b))

    def drop_tail(b):
        p = tpos.pop(b)
        x = tails.pop()
        if x != b:
            tails[p] = x
            tpos[x] = p

    def value(e, i):
        if learner:
            return learner.value(e[2], e[0])
        return table[e[2], min((i - e[1]) // width, nb)]

    def remember(b, start, c, uses, turn):
        ghost[b] = (start, c, uses, turn)
        if len(ghost) > 4 * capacity:
            _, (s, oc, _, _) = ghost.popitem(last=False)
            learner.end(oc, s, False)

    def touch(e, c, i):
        nonlocal tick
        tick += 1
        if learner:
            learner.end(e[2], e[0], True)
            learner.advance()
            learner.start(c)
        e[0], e[1], e[2] = tick, i, c
        e[5] += 1

    def victim(pinned, i):
        if policy == "lru":
            skipped, best = [], None
            while heap:
                t, b = heapq.heappop(heap)
                if b not in tpos or cached[b][0] != t:
                    continue
                if b in pinned:
                    skipped.append((t, b))
                    continue
                best = b
                break
            for it in skipped:
                heapq.heappush(heap, it)
            return best, 0.0
        best, bv, bt = None, math.inf, math.inf
        for _ in range(samples if tails else 0):
            b = tails[rnd.randrange(len(tails))]
            if b in pinned:
                continue
            e = cached[b]
            v = value(e, i)
            if v < bv or (v == bv and e[0] < bt):
                best, bv, bt = b, v, e[0]
        return best, bv

    hits = total = 0
    for i, h in enumerate(reqs):
        if policy == "index-past" and i and i % every == 0:
            table = hazard_table(trace_arrays, len(classes.ids), width, nb, i)
        n = len(h)
        k = 0
        while k < n and h[k] in cached:
            k += 1
        if i >= first:
            total += n
            hits += k
        if learner:  # what the cache and the ghost history remember of this request
            kh = k
            while kh < n and (h[kh] in cached or h[kh] in ghost):
                kh += 1
            prev = h[kh - 1] if kh >= 2 else None
            if prev is None:
                turn = 1
            else:
                turn = 1 + (cached[prev][6] if prev in cached else ghost[prev][3])
            new = n - kh

        def cls_of(j, uses):
            if policy in ("index-true", "index-past"):
                return true_cls[i][j]
            if not learner:
                return 0
            return classes.id(class_key(uses, int(j == n - 1), turn, new, n, keys))

        for j in range(k):
            e = cached[h[j]]
            touch(e, cls_of(j, e[5] + 1), i)
            if h[j] in tpos:
                heapq.heappush(heap, (e[0], h[j]))
        pinned = set(h[:k])
        admitting = True
        for j in range(k, n):
            b = h[j]
            if b in cached:  # cached below a missing block: an orphan the put reaches again
                pinned.add(b)
                touch(cached[b], cls_of(j, cached[b][5] + 1), i)
                if b in tpos:
                    heapq.heappush(heap, (tick, b))
                continue
            uses, bturn = 1, (turn if learner else 0)
            if learner and b in ghost:
                s, gc, gu, gt = ghost.pop(b)
                learner.end(gc, s, True)
                uses, bturn = gu + 1, gt
            c = cls_of(j, uses)
            ok = admitting and (j == 0 or h[j - 1] in cached)
            while ok and len(cached) >= capacity:
                vb, vv = victim(pinned, i)
                if vb is None or (policy != "lru" and (learner.value(c, learner.tick) if learner
                                                        else table[c, 0]) < vv):
                    ok = False
                    break
                e = cached.pop(vb)
                drop_tail(vb)
                if learner:
                    remember(vb, e[0], e[2], e[5], e[6])
                p = e[4]
                if p is not None and p in cached:
                    cached[p][3] -= 1
                    if cached[p][3] == 0:
                        add_tail(p)
            tick += 1
            if learner:
                learner.advance()
                learner.start(c)
            if not ok:
                admitting = False
                if learner:
                    remember(b, tick, c, uses, bturn)
                continue
            p = h[j - 1] if j else None
            if p is not None:
                cached[p][3] += 1
                if p in tpos:
                    drop_tail(p)
            cached[b] = [tick, i, c, 0, p, uses, bturn]
            add_tail(b)
            pinned.add(b)
    return hits, total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--capacity", required=True, help="N[,N...] trace blocks")
    ap.add_argument("--policy", default="lru,index-online")
    ap.add_argument("--classes", default="u,l,t,n",
                    help="features of a class, from: " + " ".join(FEATURES))
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=0, help="replay only the first M requests")
    ap.add_argument("--from", dest="first", type=int, default=0,
                    help="count hits from request M on only")
    ap.add_argument("--width", type=int, default=8,
                    help="age bucket of index-true and index-past, in requests")
    ap.add_argument("--every", type=int, default=200,
                    help="index-past: requests between re-estimates")
    args = ap.parse_args()
    keys = [k for k in args.classes.split(",") if k]
    if any(k not in FEATURES for k in keys):
        ap.error("unknown feature in --classes")
    if args.first < 0 or not 1 <= args.width <= 9600 or args.every < 1:
        ap.error("--from must be >= 0, --width 1..9600 and --every >= 1")
    with open(args.trace) as f:
        reqs = [json.loads(line)["hash_ids"] for line in f if line.strip()]
    if args.requests > 0:
        reqs = reqs[:args.requests]
    if args.first >= len(reqs):
        ap.error("--from must be below the number of requests replayed")
    for cap in (int(x) for x in args.capacity.split(",")):
        if cap <= 0:
            ap.error("capacity must be positive")
        for pol in args.policy.split(","):
            if pol not in ("lru", "index-true", "index-online", "index-past"):
                ap.error("unknown policy " + pol)
            hits, total = replay(reqs, cap, pol, keys, args.samples, args.seed, args.first,
                                 args.width, args.every)
            print(json.dumps(dict(capacity_blocks=cap, policy=pol, classes=",".join(keys),
                                  samples=args.samples, seed=args.seed, first=args.first,
                                  hit_blocks=hits, blocks=total,
                                  hit_rate=round(100.0 * hits / total, 2))))


if __name__ == "__main__":
    main()

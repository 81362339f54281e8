#!/usr/bin/env python3
"""layering_check.py - the include graph of tierkv's libraries follows the layering.

    common/   base, keys, checksum: includes nothing of the others
    kernels/  may include common/
    proto/    may include common/
    storage/  may include common/, proto/, kernels/   (never daemon/ or client/)
    daemon/   may include storage/ and the layers below (never client/)
    client/   may include common/, proto/, kernels/   (never storage/ or daemon/)
    client/kvclient.h, the installed public header, includes no tierkv header at all.

Every quoted or angled include of a .c/.h/.cu/.cuh file in those directories is resolved
the way the build resolves it (next to the including file, else by name among the tree's
headers; *.pb-c.h are proto/'s generated headers) and its owner checked against the rules.
A quoted include that names no header of the tree is an error too: an include path of the
build must not reach what the rules forbid by another name.

    usage: layering_check.py SOURCE_DIR            check the tree (exit 1 on a violation)
           layering_check.py --self-test SOURCE_DIR  check the tree, then inject one include
                                                     per forbidden edge and require each to fail
"""
import os
import re
import sys

LAYERS = ("common", "kernels", "proto", "storage", "daemon", "client")
ALLOWED = {
    "common": {"common"},
    "kernels": {"kernels", "common"},
    "proto": {"proto", "common"},
    "storage": {"storage", "common", "proto", "kernels"},
    "daemon": {"daemon", "storage", "common", "proto", "kernels"},
    "client": {"client", "common", "proto", "kernels"},
}
# the public header: what an engine compiles against, alone
PUBLIC = {os.path.join("client", "kvclient.h"): set()}
SOURCE_EXT = (".c", ".h", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
# every top-level directory whose headers an include could reach (dev/ is research: the
# mainline layers may include none of it)
OWNERS = LAYERS + ("dev", "bench", "tests")


def header_owners(root):
    """basename -> set of top-level directories holding a header of that name."""
    owners = {}
    for top in OWNERS:
        for d, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                if f.endswith((".h", ".cuh")):
                    owners.setdefault(f, set()).add(top)
    return owners


def sources(root):
    for top in LAYERS:
        for d, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if f.endswith(SOURCE_EXT):
                    yield top, os.path.relpath(os.path.join(d, f), root)


def owner_of(root, rel_file, name, quoted, owners):
    """The top-level directory an include resolves to; None for a system header."""
    here = os.path.dirname(os.path.join(root, rel_file))
    if quoted:
        p = os.path.normpath(os.path.join(here, name))
        if os.path.isfile(p):
            return os.path.relpath(p, root).split(os.sep)[0]
    base = os.path.basename(name)
    if base.endswith(".pb-c.h"):
        return "proto"
    found = owners.get(base)
    if found:
        # a name held by several directories: the strictest reading (any forbidden one)
        return sorted(found)
    return "?" if quoted else None


def check(root, extra=None):
    """Violations as strings; extra = (rel_file, include line) added to that file's lines."""
    owners = header_owners(root)
    bad = []
    for top, rel in sources(root):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
            lines = fh.read().split("\n")
        if extra and extra[0] == rel:
            lines.append(extra[1])
        allowed = PUBLIC.get(rel, ALLOWED[top])
        for n, line in enumerate(lines, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            quoted, name = m.group(1) == '"', m.group(2)
            own = owner_of(root, rel, name, quoted, owners)
            if own is None:
                continue
            if own == "?":
                bad.append(f"{rel}:{n}: includes \"{name}\", which is no header of the tree")
                continue
            for o in own if isinstance(own, list) else [own]:
                if o not in allowed:
                    who = "the public header" if rel in PUBLIC else f"{top}/"
                    bad.append(f"{rel}:{n}: {who} must not include {o}/'s \"{name}\" "
                               f"(allowed: {', '.join(sorted(allowed)) or 'none'})")
    return bad


# one forbidden edge per rule: (a layer, whose first .c file gains the include, or a file;
# the header it includes)
INJECTIONS = [
    ("client", '#include "tkv_store.h"'),
    ("client", '#include "tkvd_service.h"'),
    ("client", '#include "../storage/tkv_store.h"'),
    ("client/kvclient.h", '#include "tkv_kernels.h"'),
    ("client/kvclient.h", '#include "tkv_base.h"'),
    ("storage", '#include "tkvd_config.h"'),
    ("storage", '#include "kvclient.h"'),
    ("storage", '#include "no_such_header.h"'),
    ("daemon", '#include "kvclient.h"'),
    ("common", '#include "tkv_store.h"'),
    ("common", '#include "tkv_kernels.h"'),
    ("kernels", '#include "tkv_pool.h"'),
]


def injection_target(root, where):
    if where in LAYERS:
        c = sorted(f for f in os.listdir(os.path.join(root, where)) if f.endswith(".c"))
        return os.path.join(where, c[0]) if c else None
    return where if os.path.isfile(os.path.join(root, where)) else None


def main(argv):
    self_test = "--self-test" in argv
    args = [a for a in argv[1:] if a != "--self-test"]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = os.path.abspath(args[0])
    bad = check(root)
    for b in bad:
        print("LAYERING", b)
    if bad:
        return 1
    n = sum(1 for _ in sources(root))
    print(f"layering: {n} files of {', '.join(LAYERS)} follow the rules")
    if not self_test:
        return 0
    missed = 0
    for where, line in INJECTIONS:
        rel = injection_target(root, where)
        if rel is None:
            print(f"self-test: no file for {where}; pick another one for this edge")
            missed += 1
            continue
        got = check(root, (rel, line))
        if got:
            print(f"self-test: caught {line!r} in {rel}: {got[0]}")
        else:
            print(f"self-test: MISSED {line!r} in {rel}")
            missed += 1
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python3
"""Include cycles among the sources' files: a file's quoted includes ("dir/x.h") are its edges, and
a .c file and its internal x_int.h stand for its header (x.c with x.h), so a pair of modules that include each other's
headers from their sources is a cycle. Prints each cycle found; exit 1 if any."""
import os, re, sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
inc = re.compile(r'^\s*#\s*include\s*"([a-z_]+/[a-z_/]+\.(?:h|cuh|inc))"', re.M)
edges = {}
for top in ('src', 'app'):
    for d, _, fs in os.walk(os.path.join(root, top)):
        for f in fs:
            if not f.endswith(('.c', '.h', '.cu', '.cuh', '.inc')):
                continue
            p = os.path.join(d, f)
            rel = os.path.relpath(p, os.path.join(root, 'src')) if top == 'src' else 'app/' + f
            mod = re.sub(r'(_int)?\.(c|h|cu|cuh)$', '', rel)
            for h in inc.findall(open(p, encoding='utf-8', errors='replace').read()):
                hm = re.sub(r'(_int)?\.(h|cuh)$', '', h)
                if hm != mod:
                    edges.setdefault(mod, set()).add(hm)
seen, stack, cycles = {}, [], set()
def visit(m):
    seen[m] = 1
    stack.append(m)
    for n in sorted(edges.get(m, ())):
        if seen.get(n) == 1:
            cyc = stack[stack.index(n):]
            k = min(range(len(cyc)), key=lambda i: cyc[i])
            cycles.add(' -> '.join(cyc[k:] + cyc[:k] + [cyc[k]]))
        elif n not in seen:
            visit(n)
    stack.pop()
    seen[m] = 2
sys.setrecursionlimit(10000)
for m in sorted(edges):
    if m not in seen:
        visit(m)
for c in sorted(cycles):
    print('include cycle:', c)
print('include cycles: %d' % len(cycles))
sys.exit(1 if cycles else 0)

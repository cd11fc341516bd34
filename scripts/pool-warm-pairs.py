#!/usr/bin/env python3
"""Pools part 8 warm reply pairs over several bench JSON files (target/bench/results.json
of runs of the same code): the p50 ratio on / off with a 95 % paired bootstrap interval
(2,000 resamples, pairs kept together, seeded) and the median on - off difference.
  scripts/pool-warm-pairs.py RUN1.json RUN2.json ...
"""
import json, sys, random, statistics
on=[];off=[]
for f in sys.argv[1:]:
    r=json.load(open(f))['observed']['warm_reply_pairs']
    on+=r['on']; off+=r['off']
n=len(on)
def p50(v):
    v=sorted(v); k=max(1,-(-len(v)//2)); return v[k-1]
ratio=p50(on)/p50(off)
rng=random.Random(1)
rs=[]
for _ in range(2000):
    idx=[rng.randrange(n) for _ in range(n)]
    rs.append(p50([on[i] for i in idx])/p50([off[i] for i in idx]))
rs.sort()
d=sorted((a-b)*1000 for a,b in zip(on,off))
print(f"pairs {n}: p50 on {p50(on):.3f} off {p50(off):.3f} ratio {ratio:.3f} [{rs[49]:.3f}, {rs[1949]:.3f}]; median diff {statistics.median(d):+.0f} us")

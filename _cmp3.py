import math, collections, sys
from figures import repro
base, other = sys.argv[1], sys.argv[2]
rows_c = repro.read_csv(base, "orthogonalisers")
tol = repro.tolerances(rows_c, repro.Repro())
rows_f = repro.read_csv(other, "orthogonalisers")
worst = collections.defaultdict(float)
for a, c in zip(rows_f, rows_c):
    t = tol(c); x, y = float(a["value"]), float(c["value"])
    if y > 10: continue
    key = (c["metric"], c["step"])
    worst[key] = max(worst[key], abs(x-y)/t.bound(y))
print(other, {k: round(v, 2) for k, v in sorted(worst.items()) if v > 0 and k[0]=="val_loss"})

import json, sys, glob
d = sys.argv[1]
tags = sys.argv[2:] or ["base", "head"]
def load(tag):
    ds = [json.load(open(f)) for f in sorted(glob.glob(f"{d}/{tag}_*.json"))]
    return {k: min(x[k] for x in ds) for k in ds[0]} if ds else None
res = {t: load(t) for t in tags}
tags = [t for t in tags if res[t]]
b = res[tags[0]]
print(f"{'shape':<44} " + " ".join(f"{t:>9}" for t in tags) + " " + " ".join(f"{t + '/b':>8}" for t in tags[1:]))
for k in b:
    print(f"{k:<44} " + " ".join(f"{res[t][k]:9.4f}" for t in tags) + " " + " ".join(f"{res[t][k] / b[k]:8.3f}" for t in tags[1:]))

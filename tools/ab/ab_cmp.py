"""Compare A/B rounds: python ab_cmp.py base1.json head1.json base2.json head2.json ...
Per key: min over rounds of each side, ratio head/base; profiles printed side by side."""
import json, sys
files = [json.load(open(f)) for f in sys.argv[1:]]
side = {}
for f in files:
    for k, v in f["res"].items():
        if v is not None:
            side.setdefault(f["tag"], {}).setdefault(k, []).append(v)
base, head = side["base"], side["head"]
slower = []
for k in base:
    if k not in head:
        continue
    b, h = min(base[k]), min(head[k])
    r = h / b
    mark = "SLOWER" if r > 1.03 else ("faster" if r < 0.97 else "")
    if r > 1.03:
        slower.append(k)
    print(f"{k:32s} base {b:8.4f} head {h:8.4f} ratio {r:6.3f} {mark}")
print("slower>3%:", ",".join(slower))
for f in files:
    for k, ks in f.get("prof", {}).items():
        print(f"## {f['tag']} {k}: total {sum(t for _, t in ks):.4f} ms")
        for name, t in ks:
            print(f"   {t:8.4f}  {name}")

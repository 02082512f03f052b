import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
data = collections.defaultdict(dict)
for r in rows:
    if r and r[0] == "ID":
        hdr = r; continue
    if hdr and len(r) == len(hdr):
        d = dict(zip(hdr, r))
        data[(d["ID"], d["Kernel Name"][:40])][d["Metric Name"]] = d["Metric Value"]
for k, m in data.items():
    stalls = sorted(((float(v.replace(',', '')), n.replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", ""))
                     for n, v in m.items() if "stalled" in n), reverse=True)[:8]
    other = {n: v for n, v in m.items() if "stalled" not in n}
    print(k, other)
    print("   ", ", ".join(f"{n} {v:.2f}" for v, n in stalls))

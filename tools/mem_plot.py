#!/usr/bin/env python3
"""Device memory over time from nvidia-smi traces (tools/gpu-check.sh flash: "timestamp, MiB" every
100 ms) as one SVG, a line per trace, with each trace's spread after load (samples above 90% of its
maximum) in the legend. Standard library only.

  tools/mem_plot.py -o docs/flash-memory.svg "22G, 1024 tokens=mem-a.csv" "serve 16 streams=mem-b.csv"
"""
import argparse

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def load(path):
    mib = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[1].isdigit():
            mib.append(int(parts[1]))
    return mib


def spread(mib):
    top = max(mib)
    after = [v for v in mib if v > 0.9 * top]
    return min(after), max(after), len(after)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("traces", nargs="+", help="LABEL=FILE")
    a = ap.parse_args()
    series = [(t.split("=", 1)[0], load(t.split("=", 1)[1])) for t in a.traces]
    W, H, L, B = 900, 420, 70, 40
    tmax = max(len(m) for _, m in series) / 10.0
    ymax = max(max(m) for _, m in series) * 1.1
    X = lambda t: L + (W - L - 20) * t / tmax
    Y = lambda v: H - B - (H - B - 20) * v / ymax
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">' % (W, H),
           '<rect width="100%" height="100%" fill="white"/>']
    for g in range(0, int(ymax / 1024) + 1, 4):
        out.append('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>' % (L, Y(g * 1024), W - 20, Y(g * 1024)))
        out.append('<text x="%d" y="%.1f" text-anchor="end">%d GiB</text>' % (L - 5, Y(g * 1024) + 4, g))
    for s in range(0, int(tmax) + 1, 10):
        out.append('<text x="%.1f" y="%d" text-anchor="middle">%d s</text>' % (X(s), H - B + 16, s))
    for i, (label, mib) in enumerate(series):
        c = COLORS[i % len(COLORS)]
        pts = " ".join("%.1f,%.1f" % (X(j / 10.0), Y(v)) for j, v in enumerate(mib))
        out.append('<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>' % (c, pts))
        lo, hi, n = spread(mib)
        out.append('<text x="%d" y="%d" fill="%s">%s: after load %d..%d MiB over %.1f s (spread %.2f%%)</text>' % (
            L + 10, 20 + 16 * i, c, label, lo, hi, n / 10.0, 100.0 * (hi - lo) / hi))
    out.append('<text x="%d" y="%d">device memory (nvidia-smi, every 100 ms)</text>' % (L + 10, H - 8))
    out.append("</svg>")
    open(a.out, "w").write("\n".join(out))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Attention kernel against HBM: docs/attention_bw.png from
bench/results/attention_bw.json.

One group of bars per cell (K/V dtype x contexts x layout), one bar per
kernel variant, each given as label@commit (by default the library's kernel
3 with spans as measured at 69e1f26, kernel 3 one warp per block as it was
before, measured at 0ef7754 in a call with the spans, and kernel 1 at
29f5338), as a share of the 4.4 TB/s read ceiling (FP8 bytes counted at one
per element); a tick marks the plain streaming read of the same bytes in the library's run,
the dashed line the 60% target.

usage: bench/plot_attention.py [--labels L1@C1,L2@C2] [--out PNG]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = {"k3s8": "kernel 3, 8 warps, a piece each, one launch where it fits (the library)",
         "k3s8nf": "the same, always chunk and combine kernels (before)",
         "k3w1l8": "kernel 3, one warp per block (before)",
         "w8l4c0": "kernel 1, CUDA cores, two-pass combine (the library before)",
         "w8l4": "kernel 1 with the one-pass combine",
         "k3w4": "kernel 3, 4 warps per block"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=os.path.join(HERE, "results", "attention_bw.json"))
    ap.add_argument("--labels", default="w8l4c0@29f5338,k3w1l8@0ef7754,k3s8nf@0dbda2d,k3s8@0dbda2d",
                    help="label@commit of each bar, the library's last")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "attention_bw.png"))
    a = ap.parse_args()
    labels = a.labels.split(",")
    recs = [dict(r, label=r["label"] + "@" + r.get("commit", "")) for r in
            json.load(open(a.results))["records"] if r.get("chunk") == 256]
    cells = [(dt, n, lay) for dt in ("bf16", "fp8") for n in (1, 4) for lay in ("contig", "paged")]
    by = {(r["label"], r.get("dtype", "bf16"), r["contexts"], r["variant"]): r for r in recs}
    missing = [(l,) + c for l in labels for c in cells if (l,) + c not in by]
    if missing:
        print("plot_attention.py: no record for " + ", ".join(map(str, missing)), file=sys.stderr)
        return 1
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.6), dpi=130)
    width = 0.8 / len(labels)
    for i, lab in enumerate(labels):
        xs = [k + (i - (len(labels) - 1) / 2) * width for k in range(len(cells))]
        ys = [100 * by[(lab,) + c]["ratio"] for c in cells]
        name, commit = lab.split("@")
        bars = ax.bar(xs, ys, width * 0.95, label=f"{NAMES.get(name, name)}, {commit}")
        for x, y, c in zip(xs, ys, cells):
            ax.text(x, y + 0.8, f"{y:.0f}", ha="center", fontsize=7)
            ax.text(x, 2, f"{by[(lab,) + c]['median_us']:.0f}us", ha="center", fontsize=6,
                    rotation=90, color="white")
    reads = [100 * by[(labels[-1],) + c]["read_gbps"] / 4400 for c in cells]
    ax.plot(range(len(cells)), reads, "k_", markersize=18, mew=2,
            label="plain streaming read of the same bytes, same run")
    ax.axhline(60, color="tab:red", linestyle="--", linewidth=1, label="target: 60%")
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"{dt}\n{n} ctx\n{'contiguous' if lay == 'contig' else 'paged'}"
                        for dt, n, lay in cells], fontsize=8)
    ax.set_ylabel("share of 4.4 TB/s HBM read (%)")
    ax.set_ylim(0, 128)
    ax.set_title("decode attention, llama3-8b layer, 31,744 tokens per context, chunk 256, "
                 "H200", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out)
    print(os.path.normpath(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

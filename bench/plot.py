#!/usr/bin/env python3
"""Plot the decode benchmark: tokens/s against device pool size.

Reads the JSON lines `activekv decode --json` writes: by default the current
result, bench/results/decode.jsonl (merged from a pass's $OUT/decode.jsonl by
scripts/collect-results.py, one line per preset, route and pool, each with its
date, machine, commit and command), or the files named. Draws, per geometry
preset:
  - the arena and paged routes, tokens/s at each device pool size (GiB);
  - the stage route, at pool 0;
  - the resident route as a horizontal line (all history on the device);
  - with runs of both K/V dtypes (the lines' "kv_dtype"), bf16 solid and
    fp8 dashed, each with its own PCIe bound;
  - the PCIe bound of the bytes each run staged per step
    (contexts / (bytes_h2d_per_step / pcie rate)), capped at resident, as a
    dashed curve, and the target (that bound / 1.10) as a dotted one.
Runs whose --check found a mismatch are marked with a red cross. Repeated runs
of one (preset, route, pool) are reduced to their median.

usage: bench/plot.py [decode.jsonl ...] [--out-dir docs]   (default input:
       bench/results/decode.jsonl)
Writes <out-dir>/decode_<preset>.png and prints each path.
"""
import argparse
import json
import os
import statistics
import sys
from collections import Counter, defaultdict


def load(paths):
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    print(f"plot.py: {path}:{n}: skipped, not JSON ({e})", file=sys.stderr)
                    continue
                if rec.get("cmd") == "decode":
                    runs.append(rec)
    return runs


def median_of(recs, key):
    vals = [r[key] for r in recs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def kv_dtype(r):
    """The K/V dtype of a run; lines written before FP8 existed are bf16."""
    return r.get("kv_dtype", "bf16")


def plot_preset(plt, preset, recs, out_dir):
    """One figure per preset; with runs of both K/V dtypes, the bf16 curves
    solid and the FP8 ones dashed with hollow markers (their own PCIe bound,
    half the bytes)."""
    # One geometry per figure: the runs of the preset's most common contexts
    # x tokens (a short --tp run of the same preset is not a point here).
    shape = Counter((r["contexts"], tuple(r["tokens"])) for r in recs).most_common(1)[0][0]
    recs = [r for r in recs if (r["contexts"], tuple(r["tokens"])) == shape]
    fig, ax = plt.subplots(figsize=(10.5, 4.8), dpi=130)
    dtypes = sorted({kv_dtype(r) for r in recs})
    for dt in dtypes:
        plot_dtype(ax, [r for r in recs if kv_dtype(r) == dt], dt, len(dtypes) > 1)
    # The whole-history line in the bf16 size (the pool axis is GiB of device
    # memory; an FP8 history needs half).
    first = next((r for r in recs if kv_dtype(r) == "bf16"), recs[0])
    contexts, tokens = first["contexts"], first["tokens"]
    tok = tokens[0] if tokens and all(t == tokens[0] for t in tokens) else "mixed"
    history_gib = first["history_bytes"] * contexts / (1 << 30)
    ax.set_yscale("log")
    ax.axvline(history_gib, color="tab:green", linestyle=":", linewidth=1)
    ax.text(history_gib, ax.get_ylim()[0], " whole history", color="tab:green", fontsize=8,
            va="bottom", rotation=90)
    ax.set_xlabel("device pool, or headroom over a pool of 0 (GiB)")
    ax.set_ylabel("tokens/s (all contexts)")
    ax.set_title(f"activekv decode, {preset}: {contexts} contexts x {tok} tokens, "
                 f"{first.get('backend', '?')}" + (", bf16 and fp8 K/V" if len(dtypes) > 1 else ""),
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7 if len(dtypes) > 1 else 8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = os.path.join(out_dir, f"decode_{preset}.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_dtype(ax, recs, dt, tagged):
    """The curves of one K/V dtype (tagged: name it in every label)."""
    tag = f" {dt}" if tagged else ""
    fp8 = dt == "fp8"
    by = defaultdict(list)
    for r in recs:
        if r.get("headroom_gib", 0) > 0:
            # Headroom runs (pool 0, history in headroom) plot at x = the
            # headroom cap; a run that released its headroom mid-way is a
            # time series (step_ms), not a point of the sweep.
            if "headroom_release" not in r:
                by[(r["route"] + "+headroom", r["headroom_gib"])].append(r)
            continue
        by[(r["route"], r.get("device_pool_gib", 0))].append(r)
    first = recs[0]

    resident = by.get(("resident", 0))
    res_tps = median_of(resident, "tokens_per_s") if resident else None
    if res_tps is None:  # checked runs also timed resident
        res_tps = median_of([r for r in recs if r.get("check")], "resident_tokens_per_s")

    bounds = {}
    for route, color, mark in (("arena", "tab:blue", "o-"), ("paged", "tab:purple", "D-")):
        pts = sorted((pool, rs) for (r, pool), rs in by.items() if r == route)
        if not pts:
            continue
        ax.plot([p for p, _ in pts], [median_of(rs, "tokens_per_s") for _, rs in pts],
                mark[0] + ("--" if fp8 else "-"), color=color,
                markerfacecolor="none" if fp8 else color, label=f"{route}{tag} (measured)")
        for p, rs in pts:
            b = median_of(rs, "pcie_bound_tokens_per_s")
            if b:
                bounds.setdefault(p, b)
    if ("stage", 0) in by and 0 not in bounds:  # a pool of 0 stages everything
        b = median_of(by[("stage", 0)], "pcie_bound_tokens_per_s")
        if b:
            bounds[0] = b
    # The PCIe bound of what was staged (the same bytes for both routes); a
    # step cannot beat resident either, so where resident is known the curve
    # is the lower of the two.
    bound = sorted((p, min(b, res_tps) if res_tps else b) for p, b in bounds.items())
    if bound:
        rate = first.get("pcie_gbps", 55.4)
        what = f"PCIe bound{tag} of the staged bytes at {rate:g} GB/s"
        gray = "tab:brown" if fp8 else "tab:gray"
        ax.plot([p for p, _ in bound], [b for _, b in bound], "--", color=gray,
                label=what + (", capped at resident" if res_tps else ""))
        ax.plot([p for p, _ in bound], [b / 1.10 for _, b in bound], ":", color=gray,
                label="target: within 1.10x of that")
    for route, color, mark in (("arena+headroom", "tab:cyan", "^--"),
                               ("paged+headroom", "tab:pink", "v--")):
        pts = sorted((g, rs) for (r, g), rs in by.items() if r == route)
        if pts:
            ax.plot([g for g, _ in pts], [median_of(rs, "tokens_per_s") for _, rs in pts], mark,
                    color=color, label=f"{route} (pool 0; x = headroom GiB)")
    stage = by.get(("stage", 0))
    if stage:
        ax.plot([0], [median_of(stage, "tokens_per_s")], "s", color="tab:orange", markersize=8,
                markerfacecolor="none" if fp8 else "tab:orange", label=f"stage{tag} (pool 0)")
    if res_tps:
        ax.axhline(res_tps, color="tab:green", linestyle="--" if fp8 else "-",
                   label=f"resident{tag} ({res_tps:.0f} tokens/s)")

    bad = [(pool, r["tokens_per_s"]) for (route, pool), rs in by.items()
           for r in rs if r.get("check") and r.get("bitwise") is False]
    if bad:
        ax.plot([p for p, _ in bad], [t for _, t in bad], "x", color="red", markersize=10,
                mew=2, label=f"--check mismatch{tag}")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="*", default=[os.path.join(here, "results", "decode.jsonl")],
                    help="JSON lines from activekv decode --json")
    ap.add_argument("--out-dir", default=os.path.join(here, "..", "docs"),
                    help="where the PNG files go (default: docs/)")
    args = ap.parse_args()

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 2

    runs = load(args.inputs)
    if not runs:
        print("plot.py: no decode runs in " + ", ".join(args.inputs), file=sys.stderr)
        return 1
    presets = defaultdict(list)
    for r in runs:
        if "vs_ref" in r:  # a logits-distance run, not a point of the sweep
            continue
        presets[r["preset"]].append(r)
    os.makedirs(args.out_dir, exist_ok=True)
    for preset, recs in sorted(presets.items()):
        print(plot_preset(plt, preset, recs, args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())

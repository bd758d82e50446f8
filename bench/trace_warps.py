#!/usr/bin/env python3
"""Summarizes raw per-warp traces of the attention kernel into one JSON record
per trace file: where one launch's warps and blocks end, how far the warps of
one block (one SM) and the blocks of the grid drift apart, and what the steps
after the loop cost.

The raw traces come from a diagnostic build of bench/attention_bw.cu
(-DAKV_ATTN_BENCH_TRACE=1) run with AKV_TRACE_RAW=DIR: DIR/trace-<what>.txt
holds one line per warp: warp index, SM, then 24 points in ns from the first
warp's entry (-1 where not recorded). Points (attention_cuda.cu, AKV_TRACE):
0 entry, 1 query set up, 2 + 2k / 3 + 2k group k's scores / V products done,
18 loop end, 19 partial written, 20 grid barrier passed (its timer read may be
scheduled above the barrier: not used here), 21 fold done, 22 / 23 the block
merge's first barrier passed / weights computed (absent in older builds).

usage: bench/trace_warps.py LABEL=COMMIT=FILE ... [--json OUT] [--about TEXT]
"""
import argparse
import collections
import json
import statistics as st
import sys

WARPS_PER_BLOCK = 8
ENTRY, S0, LOOP_END, WRITTEN, FOLDED, MERGE1, MERGE2 = 0, 2, 18, 19, 21, 22, 23


def spread(values):
    v = sorted(values)
    return {"min_us": round(v[0], 2), "median_us": round(st.median(v), 2), "max_us": round(v[-1], 2)}


def summarize(path):
    warps = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("#") or not line.strip():
                continue
            f = [int(x) for x in line.split()]
            pts = [None if x < 0 else x / 1e3 for x in f[2:]]
            pts += [None] * (24 - len(pts))  # builds before the merge points had 22
            warps.append({"warp": f[0], "sm": f[1], "pt": pts})
    rows = [w for w in warps if w["pt"][S0] is not None]  # warps with rows
    blocks = collections.defaultdict(list)
    for w in rows:
        blocks[w["warp"] // WARPS_PER_BLOCK].append(w)
    full = {b: ws for b, ws in blocks.items() if len(ws) == WARPS_PER_BLOCK}
    le = [w["pt"][LOOP_END] for w in rows]
    s0 = [w["pt"][S0] for w in rows]
    mx, my = st.mean(s0), st.mean(le)
    cov = sum((a - mx) * (b - my) for a, b in zip(s0, le))
    den = (sum((a - mx) ** 2 for a in s0) * sum((b - my) ** 2 for b in le)) ** 0.5
    block_mean = {b: st.mean(w["pt"][LOOP_END] for w in ws) for b, ws in blocks.items()}
    block_max = {b: max(w["pt"][LOOP_END] for w in ws) for b, ws in blocks.items()}
    rec = {
        "warps_with_rows": len(rows),
        "blocks": len(blocks),
        "loop_end": spread(le),
        "block_mean_loop_end": spread(block_mean.values()),
        "block_max_loop_end": spread(block_max.values()),
        "intra_block_spread": spread(
            max(w["pt"][LOOP_END] for w in ws) - min(w["pt"][LOOP_END] for w in ws)
            for ws in full.values()),
        "max_block_mean_full_blocks_us": round(max(block_mean[b] for b in full), 2),
        "max_block_mean_short_blocks_us": round(
            max([block_mean[b] for b in blocks if b not in full] or [0.0]), 2),
        "corr_first_group_vs_loop_end": round(cov / den, 2) if den > 0 else None,
        "written": spread(max(w["pt"][WRITTEN] for w in blocks[b]) for b in blocks),
    }
    merge_after = [max(w["pt"][WRITTEN] for w in ws) - block_max[b] for b, ws in blocks.items()]
    rec["block_merge_us"] = spread(merge_after)  # block's last loop end -> its partial written
    if all(w["pt"][MERGE1] is not None and w["pt"][MERGE2] is not None for w in rows):
        rec["merge_barrier_us"] = spread(
            max(w["pt"][MERGE1] for w in ws) - block_max[b] for b, ws in blocks.items())
        rec["merge_weights_us"] = spread(
            max(w["pt"][MERGE2] for w in ws) - max(w["pt"][MERGE1] for w in ws)
            for ws in blocks.values())
        rec["merge_outputs_us"] = spread(
            max(w["pt"][WRITTEN] for w in ws) - max(w["pt"][MERGE2] for w in ws)
            for ws in blocks.values())
    folded = [w["pt"][FOLDED] for w in warps if w["pt"][FOLDED] is not None]
    if folded:
        last_written = max(w["pt"][WRITTEN] for w in rows)
        rec["fold_done"] = spread(folded)
        rec["barrier_and_fold_us"] = round(max(folded) - last_written, 2)
    by_sm = sorted((ws[0]["sm"], round(block_mean[b], 2)) for b, ws in blocks.items())
    rec["block_mean_loop_end_by_sm"] = {str(sm): v for sm, v in by_sm}
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=COMMIT=FILE")
    ap.add_argument("--json", help="write the records here (default: stdout)")
    ap.add_argument("--about", default="")
    a = ap.parse_args()
    records = []
    for r in a.runs:
        label, commit, path = r.split("=", 2)
        records.append({"label": label, "commit": commit, **summarize(path)})
    doc = {"benchmark": "attention_bw raw per-warp trace (AKV_ATTN_BENCH_TRACE=1, AKV_TRACE_RAW)",
           "about": a.about, "records": records}
    text = json.dumps(doc, indent=1) + "\n"
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()

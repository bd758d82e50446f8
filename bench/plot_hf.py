#!/usr/bin/env python3
"""Plots bench/results/hf_compare.json: tokens/s of every cache row of
examples/hf_compare.py, one panel per geometry, with the PCIe bound of the
bytes the pool-0 row stages and the resident rows marked; the last two bars
(hatched) are the interleaved phase, where the all-retained target is read.

    python3 bench/plot_hf.py [bench/results/hf_compare.json] [docs/hf_compare.png]
"""
import json
import sys

import matplotlib

from hf_tables import paired_members

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "resident": "DynamicCache\nresident",
    "offloaded": "DynamicCache\noffloading=True",
    "stage": "ActiveKV\npool 0",
    "half": "ActiveKV\nhalf retained",
    "all": "ActiveKV\nall retained",
    "resident2": "DynamicCache\nresident (again)",
    "i_resident": "interleaved:\nresident",
    "i_all": "interleaved:\nActiveKV all",
}
COLORS = {"resident": "#777777", "resident2": "#999999", "offloaded": "#d95f02",
          "stage": "#1b9e77", "half": "#1b9e77", "all": "#1b9e77",
          "i_resident": "#777777", "i_all": "#1b9e77"}


def interleaved_rows(run):
    """The interleaved phase (resident and all retained decoded step by step in rotation,
    both caches alive) as two more bars, when the report has it."""
    p = run.get("paired")
    if not p or not p.get("ok"):
        return []
    default, _ = paired_members(p)
    return [dict(row="i_resident", tokens_per_s=p["resident"]["tokens_per_s"], bitwise=True,
                 hatch=True),
            dict(row="i_all", tokens_per_s=default["tokens_per_s"], bitwise=p["bitwise"],
                 hatch=True, ratio=default["ratio_tokens_per_s"])]


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "bench/results/hf_compare.json"
    dst = sys.argv[2] if len(sys.argv) > 2 else "docs/hf_compare.png"
    runs = json.load(open(src))["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(8 * len(runs), 4.8))
    if len(runs) == 1:
        axes = [axes]
    for ax, run in zip(axes, runs):
        rows = [r for r in run["rows"] if r.get("ok")] + interleaved_rows(run)
        x = range(len(rows))
        tps = [r["tokens_per_s"] for r in rows]
        bars = ax.bar(x, tps, color=[COLORS.get(r["row"], "#1b9e77") for r in rows])
        for b, r in zip(bars, rows):
            if r.get("hatch"):
                b.set_hatch("//")
        for i, r in enumerate(rows):
            tag = "bit-identical" if r.get("bitwise") else "DIFFERS"
            if "ratio" in r:
                tag += "\n%.3fx resident" % r["ratio"]
            ax.text(i, tps[i], "%.1f\n%s" % (tps[i], tag), ha="center", va="bottom", fontsize=7)
        stage = next((r for r in rows if r["row"] == "stage"), None)
        if stage and stage.get("pcie_bound_ms"):
            bound = 1e3 / stage["pcie_bound_ms"] * run["contexts"]
            ax.axhline(bound, color="#1b9e77", ls="--", lw=1)
            ax.text(len(rows) - 0.5, bound, "PCIe bound, pool 0", ha="right", va="bottom",
                    fontsize=7, color="#1b9e77")
        ax.set_xticks(list(x))
        ax.set_xticklabels([LABELS.get(r["row"], r["row"]) for r in rows], fontsize=7)
        ax.set_ylabel("tokens/s (%d contexts)" % run["contexts"])
        ax.set_title("%s, %d x %d tokens, bf16, SDPA (commit %s)"
                     % (run["geometry"]["preset"], run["contexts"], run["tokens"], run["commit"]),
                     fontsize=9)
        ax.set_ylim(0, max(tps) * 1.25)
    fig.suptitle("transformers decode on one H200: DynamicCache vs ActiveKVCache", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print("wrote", dst)


if __name__ == "__main__":
    main()

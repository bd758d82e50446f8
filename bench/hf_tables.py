#!/usr/bin/env python3
"""Prints the markdown tables of docs/benchmarks.md's transformers section from
bench/results/hf_compare.json (one table per geometry, then the interleaved
all-retained comparison and the targets), so the page quotes the result file.

    python3 bench/hf_tables.py [bench/results/hf_compare.json]
"""
import json
import sys

GiB = 1 << 30
NAMES = {
    "resident": "resident DynamicCache",
    "offloaded": "DynamicCache(offloading=True)",
    "stage": "ActiveKV, pool 0 (stage)",
    "half": "ActiveKV, half retained (arena)",
    "all": "ActiveKV, all retained (arena)",
    "resident2": "resident DynamicCache, again",
}


def gib(n):
    return "%.2f GiB" % (n / GiB) if n else "0"


def table(run):
    out = ["| row | tokens/s | step ms median | p90 | host ms | device peak | H2D/step "
           "| PCIe bound / measured | vs resident | bitwise |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in run["rows"]:
        if not r.get("ok"):
            out.append("| %s | %s |" % (NAMES.get(r["row"], r["row"]),
                                         r.get("skipped") or r.get("error", "failed")))
            continue
        bound = r.get("pcie_ratio")
        bits = ("reference" if r["row"] == "resident" else "%d of %d steps"
                % (r.get("steps_equal", 0), run["steps"]))
        out.append("| %s | %.1f | %.2f | %.2f | %.2f | %s | %s | %s | %.3f | %s |" % (
            NAMES.get(r["row"], r["row"]), r["tokens_per_s"], r["step_ms_median"],
            r["step_ms_p90"], r.get("host_enqueue_ms_median", 0), gib(r["device_peak_bytes"]),
            gib(r.get("h2d_bytes_per_step", 0)),
            "%.3f" % (1 / bound) if bound and r["row"] in ("stage", "half", "offloaded") else "–",
            r.get("vs_resident", 1.0), bits))
    p = run.get("paired")
    if p and p.get("ok"):
        out.append("")
        out.append("Interleaved (resident, all retained and all retained with hooks decoded "
                   "step by step in rotation, both caches alive): step medians resident "
                   "%.2f ms, all retained %.2f ms (%.3f× resident tokens/s), with hooks "
                   "%.2f ms (%.3f×); logits bit-identical on %d of %d steps."
                   % (p["resident"]["step_ms_median"], p["all"]["step_ms_median"],
                      p["all"]["ratio_tokens_per_s"], p["all_hooks"]["step_ms_median"]
                      if "all_hooks" in p else float("nan"),
                      p["all_hooks"]["ratio_tokens_per_s"] if "all_hooks" in p else float("nan"),
                      p["steps_equal"], run["steps"]))
    out.append("")
    for t in run.get("targets", []):
        out.append("- %s: %.3f (want %s): %s" % (t["target"], t["value"], t["want"],
                                                 "met" if t["ok"] else "**missed**"))
    return "\n".join(out)


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "bench/results/hf_compare.json"
    for run in json.load(open(src))["runs"]:
        g = run["geometry"]
        print("**%s geometry, %d × %d tokens, %d steps** (commit %s, %s, torch %s, "
              "transformers %s):\n" % (g["preset"], run["contexts"], run["tokens"], run["steps"],
                                       run["commit"], run["date"][:10], run["torch"],
                                       run["transformers"]))
        print(table(run))
        print()


if __name__ == "__main__":
    main()

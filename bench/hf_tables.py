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


def paired_members(p):
    """(the adapter's default all-retained member, the member with forward hooks or None) of
    an interleaved phase. Reports written while hooks were the default name them "all"
    (hooks) and "all_nohooks"; later ones "all" (default, no hooks) and "all_hooks"."""
    if "all_nohooks" in p:
        return p["all_nohooks"], p["all"]
    return p["all"], p.get("all_hooks")


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
        default, hooks = paired_members(p)
        out.append("")
        out.append("Interleaved (resident, all retained without hooks, the adapter's default, "
                   "and with hooks, decoded step by step in rotation, all caches alive): step "
                   "medians resident %.2f ms, all retained %.2f ms (**%.3f×** resident "
                   "tokens/s), with hooks %s; logits bit-identical on %d of %d steps."
                   % (p["resident"]["step_ms_median"], default["step_ms_median"],
                      default["ratio_tokens_per_s"],
                      "%.2f ms (%.3f×)" % (hooks["step_ms_median"], hooks["ratio_tokens_per_s"])
                      if hooks else "not run", p["steps_equal"], run["steps"]))
    out.append("")
    old_names = bool(p and "all_nohooks" in p)
    for t in run.get("targets", []):
        name = t["target"]
        if old_names and name.startswith("all_nohooks "):
            name = "all retained, hooks=False (now the default)" + name[len("all_nohooks"):]
        elif old_names and name.startswith("all tokens/s"):
            name = "all retained, hooks=True" + name[len("all"):]
        out.append("- %s: %.3f (want %s): %s" % (name, t["value"], t["want"],
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

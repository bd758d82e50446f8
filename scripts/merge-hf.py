#!/usr/bin/env python3
"""Merge examples/hf_compare.py reports (--json files from a GPU pass) into
bench/results/hf_compare.json: one current run per preset, a newer report of a
preset replacing the older one (git keeps the history).

usage: scripts/merge-hf.py REPORT.json [REPORT.json ...] [--results DIR]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+")
    p.add_argument("--results", default=os.path.join(HERE, "..", "bench", "results"))
    a = p.parse_args(argv)
    path = os.path.join(a.results, "hf_compare.json")
    with open(path) as f:
        current = json.load(f)
    runs = {r["geometry"]["preset"]: r for r in current["runs"]}
    for rp in a.reports:
        with open(rp) as f:
            rep = json.load(f)
        preset = rep["geometry"]["preset"]
        runs[preset] = rep
        print("%s: %s at %s (%s)" % (path, preset, rep.get("commit"), rep.get("date")))
    current["runs"] = [runs[k] for k in sorted(runs, key=lambda k: k != "llama3.1-8b")]
    with open(path, "w") as f:
        json.dump(current, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

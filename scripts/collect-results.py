#!/usr/bin/env python3
"""Merge what a GPU pass wrote under $OUT into the one current result file of
each benchmark in bench/results/ (git keeps the history; no pass files):

  decode.jsonl      one line per decode run (activekv decode --json), keyed by
                    preset, route, device pool, contexts, tokens, steps, warm-up,
                    K/V dtype (lines without one are bf16), headroom cap,
                    headroom release step and tensor parallel size (without:
                    1); the FP8 logits-distance run (fp8-distance.json, with
                    "vs_ref") and the headroom sweep
                    (headroom.jsonl) too
  attention_bw.json the attention kernel benchmark, keyed by variant label,
                    layout, contexts, tokens, chunk and dtype
  host_cost.json    the engine's host cost runs and the cudart call costs;
                    appended (the figure is a median over runs), unless
                    --restart host_cost says the per-layer path changed
  gpu_pass.json     the last result of each check: bitwise cells, the gpu and
                    cli labels, sanitizers, the demo, the summary table, keyed
                    by check
  hf_compare.json   examples/hf_compare.py reports (hf_<preset>.json), one
                    current run per geometry; each report keeps its own date,
                    commit and command

Every record carries the date, machine, commit and command of the pass that
produced it (and `source`, where it came from), so a file can hold records
of several passes and each figure still says how to reproduce it. A record
with the key of an existing one replaces it.

usage: scripts/collect-results.py OUT_DIR COMMIT "COMMAND" [--machine TEXT]
                                  [--source TEXT] [--restart BENCH ...]
                                  [--results DIR]
"""
import argparse
import datetime
import glob
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_RESULTS = os.path.join(HERE, "..", "bench", "results")
DEFAULT_MACHINE = "NVIDIA H200 (nvidia-h200), driver 580.159.04, CUDA 13.0"
META = ("date", "machine", "commit", "command", "source")

# The current file of each benchmark and the fields that identify a record.
DECODE_KEY = ("preset", "route", "device_pool_gib", "contexts", "tokens", "steps", "warmup",
              "kv_dtype", "headroom_gib", "release_step", "tp")
ATTENTION_KEY = ("label", "variant", "contexts", "tokens", "chunk", "dtype")
# Key fields records written before they existed lack, with the value they meant.
KEY_DEFAULTS = {"kv_dtype": "bf16", "dtype": "bf16", "headroom_gib": 0, "release_step": None,
                "tp": 1}
GPU_PASS_KEY = ("check",)


def jsonl(path):
    """JSON objects of a log or .jsonl file, one per line ("JSON " prefix allowed)."""
    rows = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if line.startswith("JSON "):
                    line = line[5:]
                if line.startswith("{"):
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        pass
    return rows


def host_cost(out):
    """host_cost records: JSON lines of bench.log and hostcost.log, or, where a
    run kept only its human line, that line parsed."""
    rows = []
    for f in ("bench.log", "hostcost.log"):
        p = os.path.join(out, f)
        if not os.path.exists(p):
            continue
        got = [r for r in jsonl(p) if r.get("bench") == "host_cost"]
        if not got:
            for line in open(p, encoding="utf-8"):
                m = re.match(r"host cost per layer per step \(enqueue path\): median ([\d.]+) us, "
                             r"p90 ([\d.]+) us.*\((\d+) steps x (\d+) layers, (\d+) contexts, "
                             r"backend (\w+)\)", line)
                if m:
                    got.append({"bench": "host_cost", "backend": m[6], "layers": int(m[4]),
                                "contexts": int(m[5]), "steps": int(m[3]),
                                "enqueue_us_per_layer_median": float(m[1]),
                                "enqueue_us_per_layer_p90": float(m[2]), "bound_us": 10,
                                "parsed_from": f + " (human line)"})
        rows += got
    return rows


def cudart_cost(out):
    """cudart_cost records, one list per run of akv_cudart_cost (a run is the
    calls between two repeats of its first call)."""
    calls = [r for f in ("bench.log", "cudart.log", "hostcost.log")
             for r in jsonl(os.path.join(out, f)) if r.get("bench") == "cudart_cost"]
    runs, first = [], None
    for c in calls:
        if first is None:
            first = c.get("call")
        if c.get("call") == first or not runs:
            runs.append([])
        runs[-1].append(c)
    return runs


def cells(out):
    got = []
    for f in ("LastTest.log", "ctest-gpu.log"):
        p = os.path.join(out, f)
        if os.path.exists(p):
            for line in open(p, encoding="utf-8"):
                m = re.match(r"\s*cell (\w+)\s+len=(\d+)\s+ctx=(\d+) pool=(\w+)\s*: (\d+) steps "
                             r"bit-identical", line)
                if m:
                    got.append({"route": m[1], "len": int(m[2]), "contexts": int(m[3]),
                                "pool": m[4], "steps": int(m[5]), "bit_identical": True})
            if got:
                break
    return got


def gpu_pass_checks(out):
    """One record per check this pass ran (absent checks leave the old record)."""
    checks = []
    c = cells(out)
    if c:
        checks.append({"check": "cells", "cells": c,
                       "all_bit_identical": all(x["bit_identical"] for x in c)})
    ctest = os.path.join(out, "ctest-gpu.log")
    if os.path.exists(ctest):
        keep = [l.strip() for l in open(ctest, encoding="utf-8")
                if re.search(r"tests passed|\*\*\*Failed|Not Run|Skipped", l)]
        if keep:
            checks.append({"check": "gpu_label", "lines": keep})
    san = os.path.join(out, "sanitizer.log")
    if os.path.exists(san):
        lines = [l.strip().lstrip("= ") for l in open(san, encoding="utf-8")
                 if "ERROR SUMMARY" in l or "RACECHECK SUMMARY" in l
                 or l.startswith("== compute-sanitizer")]
        if lines:
            checks.append({"check": "sanitizer", "lines": lines})
    cli = os.path.join(out, "cli.log")
    if os.path.exists(cli):
        keep = [l.rstrip("\n") for l in open(cli, encoding="utf-8")
                if re.search(r"tests passed|ERROR SUMMARY|bitwise|^== ", l)]
        if keep:
            checks.append({"check": "cli", "lines": keep})
    demo = os.path.join(out, "demo.log")
    if os.path.exists(demo):
        checks.append({"check": "demo", "output": open(demo, encoding="utf-8").read().splitlines()})
    summ = os.path.join(out, "summary.txt")
    if os.path.exists(summ):
        checks.append({"check": "summary", "lines": open(summ, encoding="utf-8").read().splitlines()})
    return checks


# ---------------------------------------------------------------- merging
def key_of(rec, fields):
    # release_step: the step of a mid-run headroom release (a run of its own,
    # not the same run as the one that kept its headroom).
    rel = rec.get("headroom_release")
    rec = {**rec, "release_step": rel.get("step") if isinstance(rel, dict) else None}
    return json.dumps([rec.get(f, KEY_DEFAULTS.get(f)) for f in fields], sort_keys=True)


def merge(old, new, fields):
    """Records of `new` replace those of `old` with the same key; order kept,
    new keys appended."""
    index = {key_of(r, fields): i for i, r in enumerate(old)}
    merged = list(old)
    for r in new:
        k = key_of(r, fields)
        if k in index:
            merged[index[k]] = r
        else:
            index[k] = len(merged)
            merged.append(r)
    return merged


def stamp(records, meta):
    """Each record gets the pass's metadata first, then its own fields."""
    return [{**meta, **{k: v for k, v in r.items() if k not in META}} for r in records]


def read_doc(path, bench, about):
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    return {"benchmark": bench, "about": about, "records": []}


def write_doc(path, doc):
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")


def read_jsonl(path):
    return jsonl(path)


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, separators=(",", ":")) + "\n")


ABOUT = {
    "attention_bw": "bench/attention_bw.cu: decode attention over one layer's history, "
                    "median of timed launches; bound: the 4.4 TB/s HBM read ceiling",
    "host_cost": "bench/host_cost.c (engine enqueue time per layer per step; bound 10 us) and "
                 "bench/cudart_cost.cu (the CUDA runtime calls of that path, one run per list)",
    "gpu_pass": "scripts/gpu-pass.sh: the last result of each GPU check (bitwise cells, "
                "compute-sanitizer, the CLI label, the summary table)",
}


def collect(results, meta, decode=(), attention=(), host=(), cudart_runs=(), checks=(),
            restart=(), hf=()):
    """Merges one pass into the current files under `results`; returns the
    paths it wrote."""
    os.makedirs(results, exist_ok=True)
    wrote = []
    if decode or "decode" in restart:
        p = os.path.join(results, "decode.jsonl")
        old = [] if "decode" in restart else read_jsonl(p)
        write_jsonl(p, merge(old, stamp(decode, meta), DECODE_KEY))
        wrote.append(p)
    if attention or "attention_bw" in restart:
        p = os.path.join(results, "attention_bw.json")
        doc = read_doc(p, "attention_bw", ABOUT["attention_bw"])
        old = [] if "attention_bw" in restart else doc["records"]
        doc["records"] = merge(old, stamp(attention, meta), ATTENTION_KEY)
        write_doc(p, doc)
        wrote.append(p)
    if host or cudart_runs or "host_cost" in restart:
        p = os.path.join(results, "host_cost.json")
        doc = read_doc(p, "host_cost", ABOUT["host_cost"])
        doc.setdefault("cudart_runs", [])
        if "host_cost" in restart:
            doc["records"], doc["cudart_runs"] = [], []
        doc["records"] += stamp(host, meta)
        doc["cudart_runs"] += [{**meta, "calls": [{k: v for k, v in c.items() if k != "bench"}
                                                  for c in run]} for run in cudart_runs]
        write_doc(p, doc)
        wrote.append(p)
    if checks or "gpu_pass" in restart:
        p = os.path.join(results, "gpu_pass.json")
        doc = read_doc(p, "gpu_pass", ABOUT["gpu_pass"])
        old = [] if "gpu_pass" in restart else doc["records"]
        doc["records"] = merge(old, stamp(checks, meta), GPU_PASS_KEY)
        write_doc(p, doc)
        wrote.append(p)
    if hf:
        # hf_compare.py reports carry their own date, commit and command; one current run
        # per geometry, the 8B first.
        p = os.path.join(results, "hf_compare.json")
        with open(p) as f:
            doc = json.load(f)
        runs = {r["geometry"]["preset"]: r for r in doc["runs"]}
        for r in hf:
            # The commit is the one the pass built (COMMIT): the report's own
            # comes from git on the GPU machine, whose copy of the tree may
            # carry stale git metadata; a differing one is kept beside it.
            if r.get("commit") != meta["commit"]:
                r["reported_commit"] = r.get("commit")
                r["commit"] = meta["commit"]
            runs[r["geometry"]["preset"]] = r
        doc["runs"] = [runs[k] for k in sorted(runs, key=lambda k: k != "llama3.1-8b")]
        with open(p, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        wrote.append(p)
    return wrote


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the folder the GPU pass wrote ($OUT)")
    ap.add_argument("commit", help="the commit the pass built")
    ap.add_argument("command", help="the command that ran the pass")
    ap.add_argument("--machine", default=DEFAULT_MACHINE)
    ap.add_argument("--source", default=None, help="where the records came from [OUT_DIR]")
    ap.add_argument("--restart", action="append", default=[],
                    choices=["decode", "attention_bw", "host_cost", "gpu_pass"],
                    help="drop that benchmark's current records first")
    ap.add_argument("--results", default=DEFAULT_RESULTS)
    a = ap.parse_args()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": a.machine, "commit": a.commit, "command": a.command,
            "source": a.source or a.out}
    wrote = collect(
        a.results, meta,
        decode=[r for f in ("decode.jsonl", "fp8-distance.json", "headroom.jsonl")
                for r in jsonl(os.path.join(a.out, f)) if r.get("cmd") == "decode"],
        attention=[r for r in jsonl(os.path.join(a.out, "bench.jsonl"))
                   if r.get("bench") == "attention_bw"],
        host=host_cost(a.out), cudart_runs=cudart_cost(a.out), checks=gpu_pass_checks(a.out),
        hf=[json.load(open(f)) for f in sorted(glob.glob(os.path.join(a.out, "hf_*.json")))],
        restart=a.restart)
    if not wrote:
        print("collect-results: nothing to merge under " + a.out, file=sys.stderr)
        return 1
    for p in wrote:
        print(os.path.normpath(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())

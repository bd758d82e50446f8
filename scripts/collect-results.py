#!/usr/bin/env python3
"""Turn the files a GPU pass wrote under $OUT into one JSON document under
bench/results/, with date, machine, commit and command.

usage: scripts/collect-results.py OUT_DIR NAME COMMIT "COMMAND" [machine]
"""
import json
import os
import re
import sys
import datetime


def jsonl(path):
    rows = []
    if os.path.exists(path):
        for line in open(path):
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
            for line in open(p):
                m = re.match(r"host cost per layer per step \(enqueue path\): median ([\d.]+) us, "
                             r"p90 ([\d.]+) us.*\((\d+) steps x (\d+) layers, (\d+) contexts, "
                             r"backend (\w+)\)", line)
                if m:
                    got.append({"bench": "host_cost", "backend": m[6], "layers": int(m[4]),
                                "contexts": int(m[5]), "steps": int(m[3]),
                                "enqueue_us_per_layer_median": float(m[1]),
                                "enqueue_us_per_layer_p90": float(m[2]), "bound_us": 10,
                                "source": f + " (human line)"})
        rows += got
    return rows


def main():
    out, name, commit, command = sys.argv[1:5]
    machine = sys.argv[5] if len(sys.argv) > 5 else "NVIDIA H200 (nvidia-h200), driver 580.159.04, CUDA 13.0"
    doc = {
        "date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine,
        "commit": commit,
        "command": command,
        "attention": [r for r in jsonl(os.path.join(out, "bench.jsonl")) if r.get("bench") == "attention_bw"],
        "host_cost": host_cost(out),
        "cudart_cost": [r for f in ("bench.log", "cudart.log", "hostcost.log")
                        for r in jsonl(os.path.join(out, f)) if r.get("bench") == "cudart_cost"],
        "decode": jsonl(os.path.join(out, "decode.jsonl")),
    }
    cells = []
    for f in ("LastTest.log", "ctest-gpu.log"):
        p = os.path.join(out, f)
        if os.path.exists(p):
            for line in open(p):
                m = re.match(r"\s*cell (\w+)\s+len=(\d+)\s+ctx=(\d+) pool=(\w+)\s*: (\d+) steps bit-identical", line)
                if m:
                    cells.append({"route": m[1], "len": int(m[2]), "contexts": int(m[3]),
                                  "pool": m[4], "steps": int(m[5]), "bit_identical": True})
            if cells:
                break
    doc["cells"] = cells
    san = os.path.join(out, "sanitizer.log")
    if os.path.exists(san):
        doc["sanitizer"] = [l.strip().lstrip("= ") for l in open(san)
                            if "ERROR SUMMARY" in l or "RACECHECK SUMMARY" in l or l.startswith("== compute-sanitizer")]
    summ = os.path.join(out, "summary.txt")
    if os.path.exists(summ):
        doc["summary"] = open(summ).read().splitlines()
    path = os.path.join(os.path.dirname(__file__), "..", "bench", "results", name + ".json")
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(path)


if __name__ == "__main__":
    main()

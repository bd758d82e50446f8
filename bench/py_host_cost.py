"""py_host_cost.py - the lease calls' host time per layer as the transformers adapter
makes them (ctypes, prototypes set once: activekv.transformers._LeaseAPI's shape),
next to bench/host_cost.c's C loop at the same geometry. Needs torch (the adapter's
module imports it).

32 layers, 4 contexts of HISTORY rows (8 KV heads x 128, bf16), route arena with a
device pool holding every page (all retained) or route stage (--pool 0); no attention
(the lease's stream only orders the calls). Per layer: begin, wait_ready,
mark_consumed, write_back, seal; the step's leases are retired after its last layer.
With --thrash MiB a numpy buffer of that size is walked before each begin and each
mark_consumed, outside the timed calls (what model code between the calls does to the
CPU caches). Prints the median per call and one JSON line.

usage: python bench/py_host_cost.py [--history 31744] [--pool 20] [--steps 24]
                                    [--thrash 0]
"""
import argparse
import ctypes
import json
import statistics
import time

import numpy as np

import activekv
from activekv import _lib

CALLS = ("begin", "wait_ready", "mark_consumed", "write_back", "seal")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--history", type=int, default=31744)
    p.add_argument("--pool", type=int, default=20, help="device pool GiB (0: route stage)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--thrash", type=int, default=0, help="MiB walked between calls")
    p.add_argument("--backend", default="cuda")
    a = p.parse_args()
    layers, n_ctx, heads, dim = 32, 4, 8, 128
    max_tokens = a.history + a.steps + 64
    host_gib = (max_tokens * layers * n_ctx * 4 * heads * dim >> 30) + 4
    cfg = dict(backend=a.backend, n_dense_layers=layers, kv_heads=heads, head_dim=dim,
               max_tokens=max_tokens, page_tokens=256, max_contexts=n_ctx,
               host_pool_gib=host_gib, log_level="warn")
    if a.pool > 0:
        cfg.update(route="arena", device_pool_gib=a.pool)
    eng = activekv.Engine(**cfg)
    ctxs = [eng.open_context() for _ in range(n_ctx)]
    chunk = 1024
    rows = np.zeros((layers, chunk, heads, dim), dtype=np.uint16)
    for c in ctxs:
        done = 0
        while done < a.history:
            n = min(chunk, a.history - done)
            part = rows if n == chunk else np.ascontiguousarray(rows[:, :n])
            c.append(part, part)
            done += n
    stream = eng.stream_create()

    # The adapter's own call objects (activekv.transformers._LeaseAPI: a private CDLL
    # handle, prototypes set once), so the figures are those of its calls.
    from activekv.transformers import _LeaseAPI
    api = _LeaseAPI(_lib.library_path())
    begin, wait_ready, mark = api.begin, api.wait_ready, api.mark_consumed
    wb, seal, retire = api.write_back, api.seal, api.retire
    vp = ctypes.c_void_p

    thrash = np.zeros((a.thrash << 20) // 8, dtype=np.int64) if a.thrash else None
    h, sh = eng._handle, stream.handle
    lease = vp()
    view = _lib.akv_view()
    attn = [_lib.akv_fence() for _ in range(layers)]
    tail = [_lib.akv_fence() for _ in range(layers)]
    leases = [None] * layers
    per = {c: [] for c in CALLS}
    clock = time.perf_counter
    for step in range(a.steps):
        eng.step_begin(ctxs)
        sums = dict.fromkeys(CALLS, 0.0)
        for layer in range(layers):
            if thrash is not None:
                thrash += 1
            t0 = clock()
            s0 = begin(h, layer, ctypes.byref(lease))
            t1 = clock()
            s1 = wait_ready(lease, sh, ctypes.byref(view))
            t2 = clock()
            if thrash is not None:
                thrash += 1
            t2b = clock()
            s2 = mark(lease, sh, ctypes.byref(attn[layer]))
            t3 = clock()
            s3 = wb(lease, None, 0, ctypes.byref(tail[layer]))
            t4 = clock()
            s4 = seal(lease, tail[layer], attn[layer])
            t5 = clock()
            if s0 or s1 or s2 or s3 or s4:
                raise RuntimeError("layer %d: %s" % (layer, (s0, s1, s2, s3, s4)))
            leases[layer] = lease.value
            sums["begin"] += t1 - t0
            sums["wait_ready"] += t2 - t1
            sums["mark_consumed"] += t3 - t2b
            sums["write_back"] += t4 - t3
            sums["seal"] += t5 - t4
        for layer in range(layers):
            if retire(leases[layer], None):
                raise RuntimeError("retire %d" % layer)
        eng.step_end()
        if step >= a.warmup:
            for c in CALLS:
                per[c].append(sums[c] / layers * 1e6)
    med = {c: statistics.median(per[c]) for c in CALLS}
    total = sum(med.values())
    print("py_host_cost: history %d, pool %d GiB (%s), thrash %d MiB, %d steps: per layer "
          "%s; sum %.2f us" % (a.history, a.pool, "arena" if a.pool else "stage", a.thrash,
                               a.steps - a.warmup,
                               ", ".join("%s %.2f us" % (c, med[c]) for c in CALLS), total))
    print(json.dumps(dict(bench="py_host_cost", history=a.history, device_pool_gib=a.pool,
                          thrash_mib=a.thrash, steps=a.steps - a.warmup, layers=layers,
                          contexts=n_ctx, sum_us_per_layer_median=round(total, 3),
                          **{c + "_us_per_layer_median": round(med[c], 3) for c in CALLS})))
    stream.destroy()
    for c in ctxs:
        c.close()
    eng.close()


if __name__ == "__main__":
    main()

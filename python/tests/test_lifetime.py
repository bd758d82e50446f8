"""Lifetimes of the package's objects: what frees an engine dropped without
close(), and what an exception raised between a library call and the
package's bookkeeping (a Ctrl-C, a MemoryError) leaves behind.

An engine whose last reference goes is freed then, by its reference count,
not at a later garbage collection (its pinned host pool and device memory
are held until then); its contexts, leases, streams and arrays keep it
alive while they live. A call that creates a handle (engine, context,
stream, lease) and is interrupted as the library returns leaves no handle
behind that nothing can free: the handle is written by the library into the
object that owns it, and a create whose object cannot reach the caller is
undone (a lease, which cannot be undone, is handed out again by
lease_begin of its layer).

The interrupts are injected: each test wraps one library function so that it
raises right after the real call returned (a real signal lands there only by
chance). Host backend, no GPU needed.
"""
import contextlib
import gc
import weakref

import numpy as np
import pytest

import activekv as akv
from activekv import _api

from conftest import small

L, H, D = 3, 2, 8


def rows(rng, n, layers=L):
    return rng.standard_normal((layers, n, H, D)).astype(np.float32)


@contextlib.contextmanager
def no_collector(destroys):
    """The block runs with the cyclic garbage collector off: what is freed
    there is freed by reference counts. Engines an earlier test left to the
    collector go first, and are not counted."""
    gc.collect()
    destroys.clear()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run_layer(eng, lease, stream=None):
    view = lease.wait_ready(stream)
    for i in range(view.n_contexts):
        view.keys(i)[-1] = 1.0
        view.values(i)[-1] = 2.0
    attn = lease.mark_consumed()
    lease.seal(lease.write_back(), attn)
    return lease.retire()


# ------------------------------------------------------------ dropped engines


def test_dropped_engine_is_destroyed_by_its_reference_count(destroys):
    with no_collector(destroys):
        eng = akv.Engine(**small())
        h = eng._handle
        ref = weakref.ref(eng)
        del eng
        assert ref() is None
        assert destroys == [h]


def test_dropped_engine_with_contexts_streams_and_a_finished_step(destroys):
    """Contexts, streams (the default one included) and the leases of a
    finished step name their engine; the engine names them only weakly."""
    rng = np.random.default_rng(1)
    with no_collector(destroys):
        eng = akv.Engine(**small())
        h = eng._handle
        ctx = eng.open_context()
        ctx.append(rows(rng, 2), rows(rng, 2))
        other = eng.stream_create()
        eng.step_begin([ctx])
        for layer in range(L):
            run_layer(eng, eng.lease_begin(layer))
        eng.step_end()
        lease = eng.lease_begin  # a bound method holds the engine as well
        del eng
        assert destroys == []  # the context, the stream and the method hold it
        del ctx, other, lease
        assert destroys == [h]


def test_children_keep_their_engine_alive(destroys):
    rng = np.random.default_rng(2)
    with no_collector(destroys):
        eng = akv.Engine(**small())
        h = eng._handle
        ctx = eng.open_context()
        ctx.append(rows(rng, 1), rows(rng, 1))
        del eng
        assert destroys == []
        assert ctx.length == 1  # usable: its engine lives
        eng = ctx.engine
        stream = eng.stream_create()
        del eng, ctx
        assert destroys == []
        stream.synchronize()
        del stream
        assert destroys == [h]


def test_dropped_engine_mid_step_is_quarantined_and_destroyed(destroys):
    """An engine dropped with a lease unretired: close alone is refused, a
    quarantine releases the lease first (as for a garbage-collected engine),
    and that happens when the last of the engine, its context and its lease
    goes."""
    rng = np.random.default_rng(3)
    with no_collector(destroys):
        eng = akv.Engine(**small())
        h = eng._handle
        ctx = eng.open_context()
        ctx.append(rows(rng, 2), rows(rng, 2))
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        view = lease.wait_ready()
        del eng, ctx
        assert destroys == []
        del lease, view
        assert destroys == [h]


def test_dropped_engine_with_a_live_array_waits_for_the_array(destroys):
    rng = np.random.default_rng(4)
    with no_collector(destroys):
        eng = akv.Engine(**small())
        h = eng._handle
        ctx = eng.open_context()
        ctx.append(rows(rng, 2), rows(rng, 2))
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        kept = lease.wait_ready().keys(0)
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
        for layer in range(1, L):
            run_layer(eng, eng.lease_begin(layer))
        eng.step_end()
        del eng, ctx, lease
        assert destroys == []
        float(kept.sum())  # the engine's memory is still there
        del kept
        assert destroys == [h]


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("steps", [0, 2])
def test_dropped_cache_frees_its_engine_by_its_reference_count(destroys, hybrid, steps):
    """The usual transformers pattern, make a cache, generate, drop it, frees
    the engine as the cache goes (the decode step left open between forwards
    included), not at a later garbage collection."""
    from test_misuse import _cache, _kv

    torch, cache = _cache(hybrid=hybrid)
    full = [i for i, layer in enumerate(cache.layers)
            if type(layer).__name__ == "ActiveKVLayer"]
    with no_collector(destroys):
        h = cache.engine._handle
        for layer in range(len(cache.layers)):
            cache.update(*_kv(torch, 1, 3, seed=layer), layer)
        for _step in range(steps):
            for layer in range(len(cache.layers)):
                cache.update(*_kv(torch, 1, 1, seed=layer), layer)
        assert full
        del cache
        assert destroys == [h]

"""Revocable headroom (DESIGN §6) from Python, on the host backend.

The host backend models a device of host_fake_free_bytes bytes (free = that
minus what the engine allocated), so headroom is measured, filled, given back
and taken again exactly as on a GPU. As in tests/test_headroom.c, an engine
created with headroom on and no modelled device reports the engine's own
allocations; a second engine is given room for a known number of pages."""
import ctypes

import numpy as np
import pytest

import activekv as akv
from activekv import _lib

from conftest import small

L, H, D = 3, 2, 8
PAGES = 16  # headroom pages the modelled device has room for
CHUNK = 8   # pages per headroom allocation: the unit of release and take


def headroom_engine(route="arena", pages=PAGES, chunk=CHUNK, **over):
    cfg = small(route=route, headroom_gib=1, headroom_chunk_pages=chunk, **over)
    with akv.Engine(**cfg) as probe:
        info = probe.info()
        hr = probe.headroom()
    # headroom asked for, but the host backend reports no free memory: none taken
    assert hr.enabled and hr.pages == 0 and hr.profile_free_bytes == 0
    assert info.headroom_pages == 0 and info.headroom_bytes == 0
    slack = 1 if route == "paged" else 0  # as tests/testutil.c models it
    fake = info.device_bytes_allocated + (pages // chunk) * (chunk + slack) * info.page_bytes
    return akv.Engine(**dict(cfg, host_fake_free_bytes=fake)), info.page_bytes


def rows(rng, layers, n):
    shape = (layers, n, H, D) if layers else (n, H, D)
    return rng.standard_normal(shape).astype(np.float32)


def row_at(view, i, t, v):
    """Row t of context i as a writable numpy array [H, D] where the view puts
    it: the staging buffer, or (paged route) a retained page read in place."""
    addr = view.base + i * view.context_stride + t * view.row_stride
    if view.page_map is not None:
        p = t // view.page_tokens
        if p < view.page_map_stride and view.page_map[i, p] != _lib.AKV_PAGE_STAGED:
            addr = (view.pages + int(view.page_map[i, p]) * view.page_stride
                    + (t - p * view.page_tokens) * view.row_stride)
    addr += view.v_offset if v else 0
    return np.ctypeslib.as_array((ctypes.c_float * (H * D)).from_address(addr)).reshape(H, D)


def history(view, i, v):
    return np.stack([row_at(view, i, t, v) for t in range(view.len[i])])


def decode(eng, ctxs, ref, rng, steps, during=None):
    """`steps` steps over ctxs; checks the history attention sees (staged rows
    and, on the paged route, pages read in place) against `ref` (the resident
    rows, per context and layer) and appends each new row to it.
    during(step, layer) runs between lease begin and retire."""
    for s in range(steps):
        with eng.step(ctxs):
            for layer in range(L):
                lease = eng.lease_begin(layer)
                view = lease.wait_ready()
                if during is not None:
                    during(s, layer)
                for i in range(len(ctxs)):
                    n = view.len[i]
                    assert history(view, i, False).tobytes() == ref[i][layer][0].tobytes()
                    assert history(view, i, True).tobytes() == ref[i][layer][1].tobytes()
                    kn, vn = rows(rng, 0, 1), rows(rng, 0, 1)
                    row_at(view, i, n, False)[...] = kn[0]
                    row_at(view, i, n, True)[...] = vn[0]
                    ref[i][layer] = [np.concatenate([ref[i][layer][0], kn]),
                                     np.concatenate([ref[i][layer][1], vn])]
                attn = lease.mark_consumed()
                lease.seal(lease.write_back(), attn)
                lease.retire()


def open_with_history(eng, rng, lengths):
    ctxs, ref = [], []
    for n in lengths:
        c = eng.open_context()
        k, v = rows(rng, L, n), rows(rng, L, n)
        c.append(k, v)
        ctxs.append(c)
        ref.append([[k[layer], v[layer]] for layer in range(L)])
    return ctxs, ref


def check_host_rows(ctxs, ref):
    for i, c in enumerate(ctxs):
        for layer in range(L):
            k, v = c.read(layer, 0, c.length)
            assert k.tobytes() == ref[i][layer][0].tobytes()
            assert v.tobytes() == ref[i][layer][1].tobytes()


def test_config_keys_and_info():
    eng, page_bytes = headroom_engine()
    with eng:
        cfg = eng.config
        assert cfg["headroom_gib"] == 1 and cfg["headroom_chunk_pages"] == CHUNK
        assert cfg["headroom_reserve_gib"] == 0 and cfg["host_fake_free_bytes"] > 0
        hr = eng.headroom()
        assert isinstance(hr, akv.Headroom)
        assert hr.enabled and hr.max_pages == hr.pages == PAGES and hr.chunk_pages == CHUNK
        assert hr.pages_held == hr.pages_pending == 0
        assert hr.bytes == PAGES * page_bytes and hr.cap_bytes == 1 << 30
        assert hr.reserve_bytes == 0 and hr.profile_free_bytes >= hr.bytes
        assert hr.bytes_released == hr.releases == hr.takes == 0
        info = eng.info()
        assert info.headroom_pages == PAGES and info.headroom_bytes == hr.bytes
        counters = eng.admission_counters()
        assert counters["headroom_take"] == PAGES
        assert {"reclaim_headroom", "headroom", "headroom_release"} <= set(counters)
        # the engine's own headroom rows name no context
        takes = [d for d in eng.admission_log() if d.rule == "headroom_take"]
        assert takes and all(d.context is None for d in takes)


def test_defaults_and_an_engine_without_headroom():
    with akv.Engine(**small(route="arena", device_pool_gib=1)) as eng:
        cfg = eng.config
        assert cfg["headroom_gib"] == cfg["headroom_reserve_gib"] == 0
        assert cfg["host_fake_free_bytes"] == cfg["headroom_chunk_pages"] == 0
        hr = eng.headroom()
        assert not hr.enabled and hr.pages == 0 and hr.bytes == 0
        with pytest.raises(akv.NotSupported):
            eng.headroom_release(1)
        with pytest.raises(akv.NotSupported):
            eng.headroom_take()
    with pytest.raises(akv.InvalidArgument):
        akv.Engine(**small(host_fake_free_bytes=-1))
    with pytest.raises(akv.InvalidArgument):
        akv.Engine(**small(headroom_gib=1 << 32))  # does not fit its uint32_t


@pytest.mark.parametrize("route", ["arena", "paged"])
def test_release_outside_a_step_take_again_decode_bit_identical(route):
    rng = np.random.default_rng(11)
    eng, page_bytes = headroom_engine(route)
    with eng:
        ctxs, ref = open_with_history(eng, rng, [13, 10])
        decode(eng, ctxs, ref, rng, steps=3)
        counters = eng.admission_counters()
        assert counters["headroom"] > 0, "headroom retained nothing"
        info = eng.info()
        assert (info.bytes_in_place if route == "paged" else info.bytes_d2d) > 0
        hr0 = eng.headroom()
        assert hr0.pages_held > 0 and hr0.pages == PAGES
        chunk_bytes = hr0.bytes // (PAGES // CHUNK)  # allocations of equal chunks
        assert chunk_bytes >= CHUNK * page_bytes
        if route == "arena":
            assert chunk_bytes == CHUNK * page_bytes

        freed, pending = eng.headroom_release(CHUNK * page_bytes)  # one chunk, at once
        assert (freed, pending) == (chunk_bytes, 0)
        hr = eng.headroom()
        assert hr.pages == PAGES - CHUNK and hr.releases == 1
        assert hr.bytes_released == chunk_bytes and hr.bytes == hr0.bytes - chunk_bytes
        assert eng.admission_counters()["headroom_release"] == CHUNK
        decode(eng, ctxs, ref, rng, steps=2)  # rows come from the host again: same bits

        assert eng.headroom_take(0) == 0
        assert eng.headroom_take() == chunk_bytes  # None: as much as allowed
        hr = eng.headroom()
        assert hr.pages == PAGES and hr.takes == 1 and hr.bytes == hr0.bytes
        assert eng.headroom_take() == 0  # nothing left to take
        decode(eng, ctxs, ref, rng, steps=2)

        freed, pending = eng.headroom_release()  # None: all of it
        assert (freed, pending) == (hr0.bytes, 0)
        assert eng.headroom().pages == 0 and eng.info().headroom_pages == 0
        assert eng.headroom_release(1) == (0, 0)  # nothing left
        decode(eng, ctxs, ref, rng, steps=1)
        check_host_rows(ctxs, ref)


def test_release_inside_a_step_frees_at_step_end():
    rng = np.random.default_rng(12)
    eng, page_bytes = headroom_engine("paged")
    with eng:
        ctxs, ref = open_with_history(eng, rng, [17, 9])
        decode(eng, ctxs, ref, rng, steps=2)
        before = eng.headroom()
        seen = {}

        def during(step, layer):
            if layer != 1:
                return
            assert eng.headroom_release(0) == (0, 0)  # 0 bytes: nothing
            seen["release"] = eng.headroom_release()
            seen["mid"] = eng.headroom()
            with pytest.raises(akv.StepState):
                eng.headroom_take()  # a step is open

        decode(eng, ctxs, ref, rng, steps=1, during=during)
        freed, pending = seen["release"]
        assert freed == 0 and pending > 0
        mid = seen["mid"]
        assert mid.bytes == before.bytes  # nothing freed while leases may read it
        assert mid.pages_pending == before.pages
        after = eng.headroom()
        assert after.bytes == 0 and after.pages == after.pages_pending == 0
        assert after.bytes_released == before.bytes and after.releases == 1
        decode(eng, ctxs, ref, rng, steps=2)
        check_host_rows(ctxs, ref)


def test_headroom_argument_errors():
    eng, _ = headroom_engine()
    with eng:
        for bad in (-1, 1 << 64, 1.5, "all", True):
            with pytest.raises(akv.InvalidArgument):
                eng.headroom_release(bad)
            with pytest.raises(akv.InvalidArgument):
                eng.headroom_take(bad)
        assert eng.headroom().pages == PAGES  # the refusals changed nothing
    with pytest.raises(akv.BadHandle):
        eng.headroom()
    with pytest.raises(akv.BadHandle):
        eng.headroom_release()

"""Misuse of the Python package that the adversarial tests did not reach: byte
order, raw stream handles, engines and caches abandoned mid-step, copies of
handle objects, and the transformers Cache operations on hybrid models.

Each test names what a caller did and holds the package to: no leaked
engine, no silently wrong rows, no refused call that changed something.
Host backend, no GPU needed.
"""
import copy
import gc
import pickle
import threading

import numpy as np
import pytest

import activekv as akv
from activekv import _lib

from conftest import quiet, small

L, H, D = 3, 2, 8


def rows(rng, n, dtype=np.float32, layers=L):
    return rng.standard_normal((layers, n, H, D)).astype(dtype)


@pytest.fixture
def destroys(monkeypatch):
    """Counts akv_engine_destroy calls that freed an engine."""
    real = akv._api.lib.akv_engine_destroy
    freed = []

    def counted(h):
        st = real(h)
        if st == 0:
            freed.append(h)
        return st

    monkeypatch.setattr(akv._api.lib, "akv_engine_destroy", counted)
    return freed


# ------------------------------------------------------------ rows


@pytest.mark.parametrize("dtype,raw", [("bf16", ">u2"), ("bf16", ">i2"), ("f16", ">i2"),
                                       ("f32", ">i4")])
def test_rows_in_the_other_byte_order_are_refused(dtype, raw):
    """Raw bit patterns given big-endian would be stored byte-swapped: other
    values than the caller's, silently."""
    rng = np.random.default_rng(0)
    with akv.Engine(**small(dtype=dtype)) as eng, eng.open_context() as ctx:
        k = rng.integers(0, 1 << 15, (L, 2, H, D)).astype(raw)
        with pytest.raises(akv.InvalidArgument, match="byte order"):
            ctx.append(k, k)
        with pytest.raises(akv.InvalidArgument, match="byte order"):
            ctx.append_layer(0, k[0], k[0])
        assert ctx.length == 0
        native = k.astype(k.dtype.newbyteorder("="))
        ctx.append(native, native)
        assert ctx.read(1, 0, 2)[0].tobytes() == native[1].tobytes()


# ------------------------------------------------------------ streams


def test_wait_ready_with_a_raw_stream_handle_synchronizes_on_the_host_backend():
    """wait_ready(stream.handle) must block like wait_ready(stream): Python
    reads the view's arrays at once on the host backend."""
    rng = np.random.default_rng(1)
    release, ran = threading.Event(), []

    @_lib.HOST_FN
    def slow(_arg):  # work the caller enqueued on the stream before wait_ready
        release.wait(10)
        ran.append(True)

    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        k = rows(rng, 3)
        ctx.append(k, k)
        stream = eng.stream_create()
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        assert _lib.lib.akv_stream_launch_host(eng._handle, stream.handle, slow, None) == 0
        timer = threading.Timer(0.3, release.set)
        timer.start()
        try:
            view = lease.wait_ready(stream.handle)
            assert ran == [True], "wait_ready returned before the stream ran"
            assert np.array_equal(view.keys(0)[:3], k[0])
        finally:
            release.set()
            timer.join()
            stream.synchronize()
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
        for layer in (1, 2):
            lease = eng.lease_begin(layer)
            lease.wait_ready(stream.handle)
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            lease.retire()
        eng.step_end()
        stream.destroy()


def test_stream_with_block_left_by_an_exception_keeps_the_exception():
    rng = np.random.default_rng(2)
    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        ctx.append(rows(rng, 2), rows(rng, 2))
        with pytest.raises(RuntimeError, match="the caller's"):
            with eng.stream_create() as s:
                eng.step_begin([ctx])
                eng.lease_begin(0).wait_ready(s)
                raise RuntimeError("the caller's")  # the stream's destroy is refused (InUse)
        eng.quarantine()

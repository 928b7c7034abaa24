"""Does a Mooncake read the client reported failed go on writing into its buffer, and does closing
the client stop it? The fact the Mooncake backend's direct reads rest on (see ``mooncake_store``).

One run per variant, each against its own local store (metadata server, master, segment holder):
a value of ``--mib`` MiB is read with ``batch_get_into`` into an unregistered buffer filled with
0xEE while the holder is SIGSTOPped and let run for a few milliseconds every ``--stop-s`` seconds.
The transfer keeps making progress (the transport's 30 s no-progress deadline never fires) and
outlasts the client's 60 s wait, so the call returns failed while bytes are still arriving.

- ``plain``: the client is left alone; then the holder runs freely for ``--settle-s`` seconds.
- ``close``: the client is closed as soon as the call returns; then the holder runs freely.
- ``deadline``: tpcache's Mooncake backend with a deadline (``--deadline-s``) reads the value
  into a caller's buffer filled with 0xEE while the holder is stopped outright (SIGSTOP, not
  throttled): ``get`` answers a miss at the deadline, later calls fail fast while the abandoned
  call has not returned; then the holder runs again for ``--settle-s`` seconds (the abandoned
  transfer completes, into the staging buffer), and the caller's buffer is read again.
  ``late_write`` says whether any byte of it changed after ``get`` returned; expected false.

It prints one JSON object per variant: the call's code and seconds, bytes of the buffer that are no
longer 0xEE at return, after ``close`` (``close`` only) and after the settle time, and
``late_write``: whether the buffer changed after the last point the caller controls (the return
for ``plain``, the end of ``close`` for ``close``). Expected on mooncake-transfer-engine 0.3.13:
plain true, close false. It takes about 80 s per variant; run it as root (a private network
namespace, as the tests use).

Usage: ``python scripts/mooncake_late_write.py [--variant plain|close|deadline|both|all] [--mib 220]``
(``both``: plain and close; ``all``: the three)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpcache.io.storage.mooncake_store import _load_client  # noqa: E402
from tpcache.testing import netns  # noqa: E402
from tpcache.testing.servers import MooncakeStore  # noqa: E402

FILL = 0xEE


def _written(buf: mmap.mmap) -> int:
    return len(buf) - buf[:].count(FILL)


def run(variant: str, nbytes: int, stop_s: float, settle_s: float) -> dict[str, object]:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    client = _load_client()
    with MooncakeStore(tempfile.mkdtemp(prefix="late-write-"), holder_bytes=nbytes + (32 << 20)) as store:
        writer = client()
        assert writer.setup("127.0.0.1", store.metadata, 0, 16 << 20, "tcp", "", store.master) == 0
        src = mmap.mmap(-1, nbytes)
        src.write(os.urandom(1 << 20) * (nbytes >> 20))
        src_addr = ctypes.addressof(ctypes.c_char.from_buffer(src))
        assert writer.register_buffer(src_addr, nbytes) == 0
        assert list(writer.batch_put_from(["big"], [src_addr], [nbytes])) == [0]
        reader = client()
        assert reader.setup("127.0.0.1", store.metadata, 0, 16 << 20, "tcp", "", store.master) == 0
        dst = mmap.mmap(-1, nbytes)
        dst.write(bytes([FILL]) * nbytes)
        dst_addr = ctypes.addressof(ctypes.c_char.from_buffer(dst))

        stop = threading.Event()

        def throttle() -> None:
            while not stop.is_set():
                os.kill(store.holder_pid, signal.SIGSTOP)
                stop.wait(stop_s)
                os.kill(store.holder_pid, signal.SIGCONT)
                time.sleep(0.003)
            os.kill(store.holder_pid, signal.SIGCONT)

        thread = threading.Thread(target=throttle)
        t0 = time.monotonic()
        thread.start()
        codes = list(reader.batch_get_into(["big"], [dst_addr], [nbytes]))
        out: dict[str, object] = {"variant": variant, "codes": codes, "call_s": round(time.monotonic() - t0, 1)}
        out["written_at_return"] = last = _written(dst)
        if variant == "close":
            reader.close()
            out["written_after_close"] = last = _written(dst)
        stop.set()
        thread.join()
        time.sleep(settle_s)
        out["written_after_settle"] = _written(dst)
        out["late_write"] = out["written_after_settle"] != last
        out["bytes"] = nbytes
        if variant == "plain":
            reader.close()
        writer.close()
    return out


def run_deadline(nbytes: int, deadline_s: float, settle_s: float) -> dict[str, object]:
    """The backend's own read, with a deadline, from a stopped holder (see the module docstring)."""
    from tpcache.io.storage import StorageKey, open_storage

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    with MooncakeStore(tempfile.mkdtemp(prefix="late-write-"), holder_bytes=nbytes + (32 << 20)) as store:
        url = f"{store.url}&deadline={deadline_s}&retry_s=0.5&staging={nbytes + (1 << 20)}"
        backend = open_storage(url, shard=(0, 1))
        key = StorageKey("late", 1, 0, 1, 12345)
        page = bytearray(os.urandom(1 << 20) * (nbytes >> 20))
        assert backend.put([key], [page]) == [True]
        dst = bytearray([FILL]) * nbytes
        t0 = time.monotonic()
        os.kill(store.holder_pid, signal.SIGSTOP)
        try:
            found = backend.get([key], [dst])
            out: dict[str, object] = {"variant": "deadline", "found": found, "call_s": round(time.monotonic() - t0, 2)}
            out["written_at_return"] = last = nbytes - dst.count(FILL)
            t1 = time.monotonic()
            out["next_call_found"] = backend.get([key], [bytearray(nbytes)])
            out["next_call_s"] = round(time.monotonic() - t1, 3)
        finally:
            os.kill(store.holder_pid, signal.SIGCONT)
        time.sleep(settle_s)
        out["written_after_settle"] = nbytes - dst.count(FILL)
        out["late_write"] = out["written_after_settle"] != last
        again = bytearray(nbytes)
        for _ in range(100):
            if backend.get([key], [again]) == [True]:
                break
            time.sleep(0.1)
        out["read_after_settle_ok"] = again == page
        out["stats"] = {k: v for k, v in backend.stats().items() if k in ("deadline_exceeded", "unavailable", "hits")}
        out["bytes"] = nbytes
        backend.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=("plain", "close", "deadline", "both", "all"), default="both")
    ap.add_argument("--deadline-s", type=float, default=2.0, help="the backend's deadline (deadline variant)")
    ap.add_argument("--mib", type=int, default=220, help="value size; large enough to outlast 60 s")
    ap.add_argument("--stop-s", type=float, default=5.0, help="seconds the holder is stopped per cycle")
    ap.add_argument("--settle-s", type=float, default=10.0, help="seconds the holder then runs freely")
    args = ap.parse_args()
    why = netns.isolate()
    if why is not None:
        print(json.dumps({"error": why}))
        return 1
    variants = {"both": ("plain", "close"), "all": ("plain", "close", "deadline")}.get(args.variant, (args.variant,))
    for variant in variants:
        if variant == "deadline":
            result = run_deadline(args.mib << 20, args.deadline_s, args.settle_s)
        else:
            result = run(variant, args.mib << 20, args.stop_s, args.settle_s)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

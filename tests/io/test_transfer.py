"""Transfer engine on the CPU: byte-exact round trips, head-of-queue completion order, per-layer
readiness, error completions, wait_op (the unwind wait) and close with ops in flight."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
import torch

from tpcache.io import native, row_copy
from tpcache.io.errors import (
    EngineClosedError,
    OpIdError,
    PageIndexError,
    TransferError,
    TransferTimeoutError,
)
from tpcache.io.kv_pool import DevicePool, HostPool, KVLayout
from tpcache.io.transfer import D2H, H2D, TransferEngine

LAYOUT = KVLayout(num_layers=4, heads_per_rank=2, head_dim=8, dtype="bfloat16", page_size=4)
ODD = KVLayout(num_layers=2, heads_per_rank=1, head_dim=3, dtype="float16", page_size=3)
WAIT = 30.0  # generous bound on waits that must succeed; never reached unless the engine hangs


def fill(pool: DevicePool | HostPool, seed: int) -> dict[int, torch.Tensor]:
    """Random bytes (NaN bit patterns included) in every page; returns the expected content."""
    gen = torch.Generator().manual_seed(seed)
    pages = {}
    for page in range(pool.num_pages):
        pages[page] = torch.randint(0, 256, (pool.layout.page_bytes,), dtype=torch.uint8, generator=gen)
        pool.write_page(page, pages[page])
    return pages


@pytest.fixture
def engine_factory() -> Iterator:
    engines: list[TransferEngine] = []

    def make(host_layout: str = "page_first", layout: KVLayout = LAYOUT, pages: int = 24, **kw) -> TransferEngine:
        dev = DevicePool(layout, pages, "cpu")
        host = HostPool(layout, pages + 8, host_layout)  # type: ignore[arg-type]
        engine = TransferEngine(dev, host, **kw)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close(timeout=WAIT)


def gate_hook(
    gates: dict[tuple[int, int], threading.Event],
    log: list[tuple[int, int]] | None = None,
    entered: threading.Event | None = None,
):
    """A before_copy hook that blocks (op, layer) until its gate is set, and logs what it let through.

    `entered` is set when any gated (op, layer) reaches its gate, i.e. that copy is running.
    """

    def hook(op_id: int, layer: int) -> None:
        gate = gates.get((op_id, layer))
        if gate is not None:
            if entered is not None:
                entered.set()
            if not gate.wait(WAIT):
                raise RuntimeError("test gate never opened")
        if log is not None:
            log.append((op_id, layer))

    return hook


def use_copier(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Native modes need the extension (built at install wherever a C compiler is); torch modes turn it off."""
    if mode.startswith("native"):
        if not native.AVAILABLE:
            pytest.skip("the native row copy was not built")
        if mode == "native_stream":  # streaming stores even for tiny ops: odd heads and tails included
            monkeypatch.setattr(native, "STREAM_BYTES", 0)
    else:
        monkeypatch.setattr(native, "AVAILABLE", False)


@pytest.fixture(params=["native", "native_stream", "pairs", "staged", "staged_runs", "tiny_stage"])
def plan_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run round trips through every copy path: the native row copy (plain and streaming stores) and the
    torch planner's pair copies, staging, slice/gather runs and tiny stage chunks."""
    huge = 1 << 40
    use_copier(request.param, monkeypatch)
    settings = {
        "native": {},
        "native_stream": {},
        "pairs": {"PAIR_COPY_BYTES": 1},  # every single is a copy_; runs of 2 are slices/gathers
        "staged": {"PAIR_COPY_BYTES": huge, "RUN_BYTES": huge},  # everything through the stage
        "staged_runs": {"PAIR_COPY_BYTES": huge, "RUN_BYTES": 1},  # runs of 2 as slices/gathers, rest staged
        "tiny_stage": {"PAIR_COPY_BYTES": huge, "RUN_BYTES": huge, "STAGE_BYTES": 1},  # one row per chunk
    }[request.param]
    for name, value in settings.items():
        monkeypatch.setattr(row_copy, name, value)
    return request.param


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("layout", [LAYOUT, ODD], ids=["bf16", "odd_rows"])
def test_round_trip_is_byte_exact(engine_factory, host_layout: str, layout: KVLayout, plan_mode: str) -> None:
    engine = engine_factory(host_layout, layout)
    dev, host = engine.device_pool, engine.host_pool
    rng = random.Random(f"{host_layout}-{layout.row_bytes}-{plan_mode}")
    op = 0
    for trial in range(4):
        content = fill(dev, trial)
        n = rng.randint(1, dev.num_pages)
        pages = rng.sample(range(dev.num_pages), n)
        if trial == 1:  # contiguous runs on both sides: slice copies
            pages = list(range(3, 3 + min(n, dev.num_pages - 3)))
        slots = rng.sample(range(host.num_slots), len(pages)) if trial != 1 else [p + 5 for p in pages]
        host_before = {s: host.read_page(s) for s in range(host.num_slots)}
        op += 1
        assert engine.submit_backup(op, pages, slots).wait(WAIT).ok
        for page, slot in zip(pages, slots, strict=True):
            assert torch.equal(host.read_page(slot), content[page])
        for slot in set(range(host.num_slots)) - set(slots):
            assert torch.equal(host.read_page(slot), host_before[slot]), "a slot outside the op changed"
        # load back into other device pages, after scribbling over the device pool
        fill(dev, 100 + trial)
        dev_before = {p: dev.read_page(p) for p in range(dev.num_pages)}
        targets = rng.sample(range(dev.num_pages), len(pages))
        op += 1
        handle = engine.submit_load(op, slots, targets)
        handle.wait(WAIT)
        assert handle.ok
        for page, target in zip(pages, targets, strict=True):
            assert torch.equal(dev.read_page(target), content[page])
        for page in set(range(dev.num_pages)) - set(targets):
            assert torch.equal(dev.read_page(page), dev_before[page]), "a page outside the op changed"
    done = engine.finished()
    assert [c.op_id for c in done if c.direction == D2H] == [1, 3, 5, 7]
    assert [c.op_id for c in done if c.direction == H2D] == [2, 4, 6, 8]
    assert engine.finished() == [] and engine.pending() == 0  # each op is reported once


def test_bad_page_lists_are_rejected(engine_factory) -> None:
    engine = engine_factory()
    with pytest.raises(PageIndexError, match="more than once"):
        engine.submit_backup(1, [1, 2, 1], [3, 4, 5])
    with pytest.raises(PageIndexError, match="more than once"):
        engine.submit_load(1, [3, 3], [1, 2])
    with pytest.raises(PageIndexError, match="out of range"):
        engine.submit_backup(1, [24], [0])
    with pytest.raises(PageIndexError, match="host_slots: index 32 is out of range"):
        engine.submit_load(1, [32], [0])
    with pytest.raises(PageIndexError, match="destination"):
        engine.submit_backup(1, [1, 2], [3])
    assert engine.pending() == 0  # nothing was enqueued
    assert engine.submit_backup(1, [], []).wait(WAIT).ok  # an empty op is valid
    with pytest.raises(OpIdError, match="not greater"):
        engine.submit_load(1, [0], [0])
    with pytest.raises(OpIdError):
        engine.submit_load("7", [0], [0])  # type: ignore[arg-type]


def test_completions_are_reported_by_op_id_as_they_finish(engine_factory) -> None:
    """The engine reports what finished, in any order; which ops count as complete is the round's
    decision, not the engine's."""
    gates = {(1, -1): threading.Event()}
    engine = engine_factory(before_copy=gate_hook(gates))
    slow = engine.submit_backup(1, [0, 1], [0, 1], delay=1e-3)  # runs on its own thread, held at the gate
    fast = engine.submit_backup(2, [2], [2])
    assert fast.wait(WAIT).ok
    assert not slow.done()
    assert [c.op_id for c in engine.finished()] == [2]  # op 2 finished before op 1
    assert engine.pending() == 1 and engine.finished() == []
    gates[(1, -1)].set()
    slow.wait(WAIT)
    assert [(c.op_id, c.ok) for c in engine.finished()] == [(1, True)]
    assert engine.pending() == 0


def test_load_layers_become_ready_in_order(engine_factory, plan_mode: str) -> None:
    gates = {(7, 2): threading.Event()}
    log: list[tuple[int, int]] = []
    engine = engine_factory(before_copy=gate_hook(gates, log))
    host, dev = engine.host_pool, engine.device_pool
    content = fill(host, 5)
    handle = engine.submit_load(7, [4, 9, 1], [10, 3, 20])
    handle.wait_layer(0, timeout=WAIT)
    handle.wait_layer(1, timeout=WAIT)
    # held before layer 2: layers 0 and 1 of every page landed, layers 2 and 3 not yet
    assert handle.layer_ready(1) and not handle.layer_ready(2) and not handle.done()
    with pytest.raises(TransferTimeoutError):
        handle.wait_layer(2, timeout=0.05)
    for slot, page in [(4, 10), (9, 3), (1, 20)]:
        expected = content[slot].view(torch.bfloat16).view(LAYOUT.page_shape)
        bits = expected.view(torch.int16)  # compare bit patterns: random bytes include NaNs
        assert torch.equal(dev.k(1, page).view(torch.int16), bits[1, 0])
        assert torch.equal(dev.v(1, page).view(torch.int16), bits[1, 1])
        assert not dev.k(2, page).view(torch.int16).any() and not dev.v(3, page).view(torch.int16).any()
    assert engine.finished() == []
    gates[(7, 2)].set()
    handle.wait_layer(3, timeout=WAIT)
    assert handle.wait(WAIT).ok and [c.op_id for c in engine.finished()] == [7]
    assert log == [(7, 0), (7, 1), (7, 2), (7, 3)]
    with pytest.raises(PageIndexError):
        handle.wait_layer(4)


def test_failed_copy_completes_with_error_and_worker_survives(engine_factory) -> None:
    def hook(op_id: int, layer: int) -> None:
        if op_id in (1, 3) and layer in (-1, 2):
            raise RuntimeError(f"injected failure in op {op_id}")

    engine = engine_factory(before_copy=hook)
    failed_backup = engine.submit_backup(1, [0], [0]).wait(WAIT)
    assert not failed_backup.ok and "injected failure in op 1" in (failed_backup.error or "")
    assert engine.submit_backup(2, [1], [1]).wait(WAIT).ok  # same worker, still alive
    load = engine.submit_load(3, [1], [5])
    load.wait_layer(1, timeout=WAIT)  # layers before the failure landed
    with pytest.raises(TransferError, match="injected failure"):
        load.wait_layer(2, timeout=WAIT)
    assert not load.layer_ready(3)
    assert engine.submit_load(4, [1], [6]).wait(WAIT).ok
    assert [(c.op_id, c.ok) for c in engine.finished()] == [(1, False), (2, True), (3, False), (4, True)]


def test_wait_op_orders_release_after_the_copy(engine_factory) -> None:
    """Seed 004: unwind waits for in-flight loads into a lease's pages before releasing them."""
    gates = {(1, 1): threading.Event()}
    events: list[str] = []
    hook = gate_hook(gates)

    def logging_hook(op_id: int, layer: int) -> None:
        hook(op_id, layer)
        events.append(f"copy layer {layer}")

    engine = engine_factory(before_copy=logging_hook)
    fill(engine.host_pool, 9)
    engine.submit_load(1, [2, 3], [4, 5])
    with pytest.raises(TransferTimeoutError):
        engine.wait_op(1, timeout=0.05)

    def unwind() -> None:
        completion = engine.wait_op(1, timeout=WAIT)
        events.append(f"release pages (ok={completion.ok if completion else None})")

    releaser = threading.Thread(target=unwind)
    releaser.start()
    releaser.join(0.1)
    assert releaser.is_alive(), "unwind released the pages while a copy still writes them"
    gates[(1, 1)].set()
    releaser.join(WAIT)
    num_layers = LAYOUT.num_layers
    assert events == [f"copy layer {i}" for i in range(num_layers)] + ["release pages (ok=True)"]
    for slot, page in [(2, 4), (3, 5)]:
        assert torch.equal(engine.device_pool.read_page(page), engine.host_pool.read_page(slot))
    assert [c.op_id for c in engine.finished()] == [1]
    assert engine.wait_op(1) is None  # reported: finished long ago
    with pytest.raises(OpIdError, match="never submitted"):
        engine.wait_op(2)


def test_close_waits_for_running_copies_and_cancels_the_rest(engine_factory) -> None:
    gates = {(1, -1): threading.Event()}
    entered = threading.Event()
    engine = engine_factory(before_copy=gate_hook(gates, entered=entered))
    running = engine.submit_backup(1, [0], [0])
    queued = engine.submit_backup(2, [1], [1])  # behind op 1 on the d2h worker
    assert entered.wait(WAIT)  # op 1 is copying (held at its gate)
    delayed = engine.submit_load(3, [2], [2], delay=600.0)
    closer = threading.Thread(target=engine.close, kwargs={"timeout": WAIT})
    closer.start()
    closer.join(0.1)
    assert closer.is_alive(), "close returned while a copy was still running"
    assert running.state == "running"
    gates[(1, -1)].set()
    closer.join(WAIT)
    assert not closer.is_alive() and engine.closed
    assert running.completion().ok
    assert not queued.completion().ok and "cancelled" in (queued.error or "")
    with pytest.raises(TransferError, match="cancelled"):
        delayed.wait_layer(0, timeout=WAIT)
    assert [(c.op_id, c.ok) for c in engine.finished()] == [(1, True), (2, False), (3, False)]
    with pytest.raises(EngineClosedError):
        engine.submit_backup(4, [3], [3])
    engine.close()  # idempotent


def test_delay_hook_accepts_a_callable(engine_factory) -> None:
    seen: list[int] = []

    def delay(op_id: int) -> float:
        seen.append(op_id)
        return 0.0

    engine = engine_factory(delay=delay)
    assert engine.submit_backup(10, [0], [0]).wait(WAIT).ok
    assert engine.submit_load(11, [0], [1]).wait(WAIT).ok
    assert seen == [10, 11]
    with pytest.raises(ValueError, match="delay"):
        engine.submit_backup(12, [1], [1], delay=-1.0)


def test_copy_plan_groups_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    src = torch.tensor([10, 11, 12, 13, 40, 7, 50, 51, 30, 60, 61])
    dst = torch.tensor([0, 1, 2, 3, 10, 11, 12, 13, 20, 30, 31])
    monkeypatch.setattr(row_copy, "PAIR_COPY_BYTES", 64 << 10)
    monkeypatch.setattr(row_copy, "RUN_BYTES", 128 << 10)
    plan = row_copy.CopyPlan.build(src, dst, slab_bytes=64 << 10)  # pair copies: runs of >= 2 qualify
    assert plan.pair_copies
    assert plan.slices == [(10, 0, 4), (60, 30, 2)]
    assert [(s.tolist(), d) for s, d in plan.gathers] == [([40, 7, 50, 51], 10)]
    assert (plan.single_src.tolist(), plan.single_dst.tolist()) == ([30], [20])
    # small slabs: a run must move RUN_BYTES to be worth its own op, the rest is staged
    plan = row_copy.CopyPlan.build(src, dst, slab_bytes=32 << 10)  # staged: runs of >= 4 qualify
    assert not plan.pair_copies and plan.slices == [(10, 0, 4)] and len(plan.gathers) == 1
    assert (plan.single_src.tolist(), plan.single_dst.tolist()) == ([30, 60, 61], [20, 30, 31])
    empty = row_copy.CopyPlan.build(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), 1)
    assert empty.num_pages == 0 and not empty.slices and not empty.gathers and empty.single_dst.numel() == 0


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_page_table_rows_are_layer_kv_blocks(host_layout: str) -> None:
    host = HostPool(LAYOUT, 5, host_layout)  # type: ignore[arg-type]
    fill(host, 3)
    for dtype in (torch.int64, torch.uint8):
        table = row_copy.page_table(host, dtype)
        assert tuple(table.shape) == (5, 2 * LAYOUT.num_layers, LAYOUT.row_bytes // dtype.itemsize)
        for page in range(5):
            for layer in range(LAYOUT.num_layers):
                k = host.k(layer, page).reshape(-1).view(torch.uint8)
                v = host.v(layer, page).reshape(-1).view(torch.uint8)
                assert torch.equal(table[page, 2 * layer].view(torch.uint8), k)
                assert torch.equal(table[page, 2 * layer + 1].view(torch.uint8), v)


@pytest.mark.parametrize("mode", ["native_stream", "pairs", "staged"])
def test_round_trip_with_a_misaligned_engine_buffer(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """An engine's KV tensor may start at any element: the copy dtypes fall back to what tiles it."""
    use_copier(mode, monkeypatch)
    monkeypatch.setattr(row_copy, "PAIR_COPY_BYTES", 1 if mode == "pairs" else 1 << 40)
    pages = 6
    numel = pages * LAYOUT.page_bytes // 2
    base = torch.zeros(numel + 1, dtype=torch.bfloat16)
    tensor = base[1:].view(LAYOUT.num_layers, 2, pages, *LAYOUT.token_shape)  # 2-byte aligned only
    assert tensor.data_ptr() % 4 == 2
    dev = DevicePool.from_tensor(LAYOUT, tensor)
    host = HostPool(LAYOUT, 8, "page_first")
    content = fill(dev, 11)
    with TransferEngine(dev, host) as engine:
        assert engine.submit_backup(1, [5, 0, 3], [7, 2, 3]).wait(WAIT).ok
        dev.kv.zero_()
        assert engine.submit_load(2, [3, 7, 2], [1, 4, 2]).wait(WAIT).ok
    for page, target in [(3, 1), (5, 4), (0, 2)]:
        assert torch.equal(dev.read_page(target), content[page])
    assert base[0].view(torch.int16) == 0, "a copy wrote before the engine's buffer"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_gpu_round_trip_and_stream_wait(host_layout: str) -> None:
    dev = DevicePool(LAYOUT, 32, "cuda")
    host = HostPool(LAYOUT, 40, host_layout)  # type: ignore[arg-type]
    assert host.pinned
    content = fill(dev, 1)
    rng = random.Random(host_layout)
    pages = rng.sample(range(32), 20)
    slots = rng.sample(range(40), 20)
    targets = rng.sample(range(32), 20)
    with TransferEngine(dev, host) as engine:
        assert engine.submit_backup(1, pages, slots).wait(WAIT).ok
        for page, slot in zip(pages, slots, strict=True):
            assert torch.equal(host.read_page(slot), content[page])
        dev.kv.zero_()
        handle = engine.submit_load(2, slots, targets)
        out = []
        for layer in range(LAYOUT.num_layers):
            handle.stream_wait_layer(layer)  # the current stream now orders after that layer's copy
            out.append(dev.kv[layer].clone())
        torch.cuda.synchronize()
        handle.wait(WAIT)
        for page, target in zip(pages, targets, strict=True):
            expected = content[page].view(torch.int16).view(LAYOUT.page_shape).cuda()
            for layer in range(LAYOUT.num_layers):
                assert torch.equal(out[layer][:, target].view(torch.int16), expected[layer])
        assert [c.op_id for c in engine.finished()] == [1, 2]

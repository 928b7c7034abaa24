"""Copies by layer of engine-owned KV (``EngineTransfer`` with ``layered``), without vLLM: inside a
step a save's layer is copied only once the engine computed it (every other layer at the step's
end), a load's layers land in order and each is waited for before the engine reads it, no copy
outlives its step, and runs of consecutive blocks are copied as slices."""

from __future__ import annotations

import threading

import pytest
import torch

from tpcache.io.engine_kv import D2H, H2D, EngineKV, EngineTransfer, _runs
from tpcache.io.kv_pool import HostPool, KVLayout

BLOCKS, PAGE, LAYERS, SLOTS = 8, 4, 3, 6


def make(device: str = "cpu", **kw):
    """An engine of LAYERS layers, each [BLOCKS, PAGE, 2] holding 100 * layer + block, and its transfer."""
    layers = [torch.zeros(BLOCKS, PAGE, 2, device=device) for _ in range(LAYERS)]
    for i, t in enumerate(layers):
        for b in range(BLOCKS):
            t[b] = 100 * i + b
    kv = EngineKV([t.view(BLOCKS, -1) for t in layers])
    pool = HostPool(KVLayout(LAYERS, 1, 1, torch.float32, PAGE), SLOTS, "page_first")
    transfer = EngineTransfer(kv, pool, layered=True, **kw)
    return layers, transfer


def host_layer(transfer: EngineTransfer, slot: int, layer: int) -> torch.Tensor:
    width = PAGE * 2
    return transfer._host[slot, layer * width : (layer + 1) * width]


class Gate:
    """A layer delay that records the order of layer copies and can hold one layer back."""

    def __init__(self, hold: tuple[str, int] | None = None) -> None:
        self.order: list[tuple[str, int]] = []
        self.hold = hold
        self.release = threading.Event()

    def __call__(self, direction: str, layer: int) -> float:
        if (direction, layer) == self.hold:
            self.release.wait()
        self.order.append((direction, layer))
        return 0.0


def test_a_save_copies_a_layer_once_the_engine_computed_it_and_the_rest_at_the_steps_end() -> None:
    gate = Gate()
    layers, transfer = make(layer_delay=gate)
    transfer.begin_step()
    handle = transfer.submit_backup(1, [2, 5], [0, 3])
    assert gate.order == [] and not handle.done()  # nothing computed yet: nothing copied
    transfer.layer_computed(1)
    transfer.end_step()  # layers 0 and 2 were never handed over: copied now, waited for
    assert gate.order == [(D2H, 1), (D2H, 0), (D2H, 2)]
    assert handle.done() and handle.ok
    for layer in range(LAYERS):
        assert host_layer(transfer, 0, layer).eq(100 * layer + 2).all()
        assert host_layer(transfer, 3, layer).eq(100 * layer + 5).all()
    assert transfer.counters["save_layers_by_hook"] == 1 and transfer.counters["save_layers_at_step_end"] == 2
    assert [c.op_id for c in transfer.finished()] == [1]
    transfer.close()


def test_a_save_submitted_after_its_layer_was_computed_starts_at_once() -> None:
    _, transfer = make()
    transfer.begin_step()
    transfer.layer_computed(0)
    transfer.submit_backup(1, [1], [0])
    assert transfer.counters["save_layers_by_hook"] == 1
    transfer.end_step()
    assert transfer.counters["save_layers_at_step_end"] == LAYERS - 1
    transfer.close()


def test_a_load_layer_is_readable_when_its_wait_returns_while_later_layers_are_still_copying() -> None:
    gate = Gate(hold=(H2D, 1))
    layers, transfer = make(layer_delay=gate)
    transfer._host.fill_(-1.0)
    transfer.begin_step()
    handle = transfer.submit_load(1, [4], [6])
    transfer.wait_layer(0)
    assert layers[0][6].eq(-1).all()  # layer 0 landed
    assert layers[1][6].eq(106).all() and not handle.done()  # layer 1 is held back: not copied yet
    waiter = threading.Thread(target=transfer.wait_layer, args=(1,))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive()  # the engine would still be waiting before reading layer 1
    gate.release.set()
    waiter.join()
    assert layers[1][6].eq(-1).all()
    transfer.end_step()
    assert layers[2][6].eq(-1).all() and handle.done() and handle.ok
    assert gate.order == [(H2D, 0), (H2D, 1), (H2D, 2)]
    assert transfer.counters["load_layer_waits"] >= 1
    transfer.close()


def test_a_failed_load_releases_its_waiters_and_fails_its_op() -> None:
    def refuse(op_id: int, direction: str) -> None:
        raise RuntimeError("injected")

    _, transfer = make(before_copy=refuse)
    transfer.begin_step()
    transfer.submit_load(1, [0], [1])
    for layer in range(LAYERS):
        transfer.wait_layer(layer)  # returns: the round reports the blocks failed
    transfer.end_step()
    (completion,) = transfer.finished()
    assert not completion.ok and "injected" in (completion.error or "")
    transfer.close()


def test_outside_a_step_copies_are_synchronous() -> None:
    gate = Gate()
    layers, transfer = make(layer_delay=gate)
    handle = transfer.submit_backup(1, [3], [2])
    assert handle.done() and gate.order == []  # copied on the caller's thread, whole
    assert host_layer(transfer, 2, 2).eq(203).all()
    transfer.close()


def test_checked_copies_are_compared_after_they_landed() -> None:
    _, transfer = make()
    transfer.check = True
    transfer.begin_step()
    transfer.submit_load(1, [0], [1])
    transfer.submit_backup(2, [4], [5])
    for layer in range(LAYERS):
        transfer.wait_layer(layer)
        transfer.layer_computed(layer)
    transfer.end_step()
    assert transfer.counters["checked_layers"] == 2 * LAYERS and transfer.counters["check_failures"] == 0
    transfer.close()


def test_a_checked_load_read_before_it_landed_is_caught() -> None:
    # Negative control of the check: the destination is zeroed when a checked load starts, so a
    # layer read before its copy landed differs from the host page, whatever the block held before.
    gate = Gate(hold=(H2D, 1))
    layers, transfer = make(layer_delay=gate)
    transfer.check = True
    transfer._host.fill_(-1.0)
    transfer.begin_step()
    transfer.submit_load(1, [4], [6])
    transfer.wait_layer(0)
    (op,) = transfer._step.loads
    assert transfer.kv.layer_equal(transfer._host, op.plan, 0)
    assert not transfer.kv.layer_equal(transfer._host, op.plan, 1)  # not landed: zeros, not the page
    assert layers[1][6].eq(0).all()
    gate.release.set()
    transfer.end_step()
    assert transfer.counters["check_failures"] == 0 and transfer.counters["checked_layers"] == LAYERS
    transfer.close()


def test_consecutive_blocks_and_slots_are_copied_as_runs() -> None:
    t = torch.tensor
    assert _runs(t([4, 5, 6]), t([0, 1, 2])) == [(4, 0, 3)]
    assert _runs(t([4, 5, 9]), t([0, 1, 2])) == [(4, 0, 2), (9, 2, 1)]
    assert _runs(t([1, 3, 5, 7, 9]), t([0, 1, 2, 3, 4])) is None  # more than MAX_RUNS: one indexed copy
    layers, transfer = make()
    transfer.begin_step()
    transfer.submit_backup(1, [1, 2, 3, 7, 0], [1, 2, 3, 4, 5])  # two runs and a single block
    transfer.end_step()
    for slot, block in zip([1, 2, 3, 4, 5], [1, 2, 3, 7, 0], strict=True):
        for layer in range(LAYERS):
            assert host_layer(transfer, slot, layer).eq(100 * layer + block).all()
    transfer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copies_by_layer_on_a_side_cuda_stream_land_before_the_compute_stream_reads_them() -> None:
    layers, transfer = make("cuda")
    transfer.check = True
    transfer._host.fill_(-1.0)
    transfer.begin_step()
    transfer.submit_load(1, [0, 1], [6, 7])
    transfer.submit_backup(2, [2, 3], [2, 3])
    seen = []
    for layer in range(LAYERS):
        transfer.wait_layer(layer)  # the compute stream waits on the layer's event
        seen.append(layers[layer][6:8].sum())  # read on the compute stream after the wait
        layers[layer][2:4] += 1  # "computes" the blocks the save copies
        transfer.layer_computed(layer)
    transfer.end_step()
    assert [float(v) for v in seen] == [-2.0 * PAGE * 2] * LAYERS
    assert all(c.ok for c in transfer.finished())
    assert transfer.counters["check_failures"] == 0 and transfer.counters["checked_layers"] == 2 * LAYERS
    for layer in range(LAYERS):
        assert host_layer(transfer, 3, layer).eq(100 * layer + 3 + 1).all()
    transfer.close()

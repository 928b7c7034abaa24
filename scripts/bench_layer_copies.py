"""Overlap gain of copies by layer (the vLLM connector's ``copy_by_layer``) on a GPU.

A stand-in for one engine step: a forward pass of LAYERS layers (matrix products on the compute
stream) that loads some blocks of every layer from tpcache's host pages and saves others, through
the connector's own transfer (``tpcache.io.engine_kv.EngineTransfer``). Three ways, measured in the
same run, each the median of --runs steps with its spread:

- ``forward``: the forward pass alone (the floor);
- ``whole``: the forward pass, then every copy (``copy_by_layer`` false);
- ``layered``: loads started before the forward pass and waited for per layer (a side CUDA stream,
  events), each layer's saves started when the layer is computed (``copy_by_layer`` true).

Prints ``hidden``: the share of the copy time (whole - forward) that copies by layer hide,
(whole - layered) / (whole - forward), and ``ratio``: layered / whole. Every layered copy is
checked byte for byte once (``check_failures`` must be 0).

    .venv/bin/python scripts/bench_layer_copies.py [--json] [--runs 20]

Without a CUDA device it says so and exits 0 (``--device cpu`` runs it on the CPU's copy thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpcache.io.engine_kv import EngineKV, EngineTransfer  # noqa: E402
from tpcache.io.kv_pool import HostPool, KVLayout  # noqa: E402


def build(args: argparse.Namespace, device: torch.device, layered: bool) -> tuple[list[torch.Tensor], EngineTransfer]:
    shape = (args.blocks, args.heads, args.block_size, 2 * args.head_dim)
    layers = [torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(args.layers)]
    kv = EngineKV([t.view(args.blocks, -1) for t in layers])
    layout = KVLayout(args.layers, args.heads, args.head_dim, torch.bfloat16, args.block_size)
    pool = HostPool(layout, 2 * args.pages, "page_first")
    pool.kv.normal_()
    return layers, EngineTransfer(kv, pool, layered=layered)


def step(args, transfer: EngineTransfer, weights: list[torch.Tensor], x: torch.Tensor, mode: str, op: int) -> float:
    """One step; returns its wall time in seconds (the device synchronized before and after)."""
    n = args.pages
    loads = (list(range(1, 1 + n)), list(range(n)))  # blocks, host slots
    saves = (list(range(1 + n, 1 + 2 * n)), list(range(n, 2 * n)))
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    if mode == "layered":
        transfer.begin_step()
        transfer.submit_load(op, loads[1], loads[0])
        transfer.submit_backup(op + 1, *saves)
    for layer, w in enumerate(weights):
        if mode == "layered":
            transfer.wait_layer(layer)
        for _ in range(args.matmuls):
            x = torch.tanh(x @ w)
        if mode == "layered":
            transfer.layer_computed(layer)
    if mode == "layered":
        transfer.end_step()
    elif mode == "whole":
        transfer.submit_load(op, loads[1], loads[0])
        transfer.submit_backup(op + 1, *saves)
    sync()
    elapsed = time.perf_counter() - start
    for c in transfer.finished():
        if not c.ok:
            raise RuntimeError(f"copy {c.op_id} failed: {c.error}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pages", type=int, default=128, help="blocks loaded and blocks saved per step, each")
    ap.add_argument("--hidden", type=int, default=4096, help="the stand-in layer's matrix size")
    ap.add_argument("--matmuls", type=int, default=2, help="matrix products per layer")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_layer_copies: no CUDA device; skipped (the overlap gain is unmeasured here)")
        return 0
    args.blocks = 2 * args.pages + 1
    weights = [
        torch.randn(args.hidden, args.hidden, dtype=torch.bfloat16, device=device) / 64 for _ in range(args.layers)
    ]
    x = torch.randn(256, args.hidden, dtype=torch.bfloat16, device=device)
    _, whole = build(args, device, layered=False)
    _, layered = build(args, device, layered=True)
    layered.check = True  # the first layered step is checked byte for byte
    times: dict[str, list[float]] = {"forward": [], "whole": [], "layered": []}
    op = 0
    for run in range(args.runs + 2):  # two warm-up rounds
        for mode in ("forward", "whole", "layered"):  # interleaved: drift hits all three alike
            transfer = layered if mode == "layered" else whole
            op += 2
            t = step(args, transfer, weights, x, mode, op)
            if mode == "layered":
                layered.check = False
            if run >= 2:
                times[mode].append(t)
    med = {m: statistics.median(v) for m, v in times.items()}
    copy_time = med["whole"] - med["forward"]
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "layers": args.layers,
        "pages_each_way": args.pages,
        "layer_bytes_each_way": args.pages * args.heads * args.block_size * 2 * args.head_dim * 2,
        "runs": args.runs,
        "ms": {m: round(1e3 * v, 3) for m, v in med.items()},
        "spread_ms": {m: [round(1e3 * min(v), 3), round(1e3 * max(v), 3)] for m, v in times.items()},
        "ratio": round(med["layered"] / med["whole"], 3),
        "hidden": round((med["whole"] - med["layered"]) / copy_time, 3) if copy_time > 0 else None,
        "check_failures": layered.counters["check_failures"],
        "checked_layers": layered.counters["checked_layers"],
    }
    whole.close()
    layered.close()
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>22}: {value}")
    return 1 if out["check_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""Test-only stand-in for SGLang's kernel wheel (``sgl_kernel``), in plain torch.

Why it exists: SGLang's CPU engine imports ops from ``sgl_kernel`` while it loads, and the kernel
wheel on the package registry is a CUDA build that does not load beside the CPU torch. The two ops
the test ring's engines call are written here with torch indexing (slower than the native CPU
kernels); any other name (speculative decoding's tree ops, which the ring never runs) imports as a
function that raises when called. Here only so the test ring can run a real SGLang engine on a
CPU-only machine.
"""

from __future__ import annotations

import ctypes

import torch


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """For each KV buffer (its base address in ``data_ptrs``, its row size in bytes in
    ``strides``), copy the rows at ``src_loc`` to the rows at ``tgt_loc``."""
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf.index_copy_(0, tgt, buf.index_select(0, src))


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Write each request's new KV slots (consecutive runs of ``out_cache_loc``) into its row of
    ``req_to_token`` between ``start_offset`` and ``end_offset``."""
    at = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[at : at + n].to(req_to_token.dtype)
        at += n


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def refuse(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} is not in the test-only sgl_kernel stub")

    refuse.__name__ = name
    return refuse

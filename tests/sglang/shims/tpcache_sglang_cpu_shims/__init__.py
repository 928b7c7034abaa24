"""Test-only SGLang plugin: HiCache (the host and storage tiers) on a CPU-only machine.

Why it exists: SGLang's HiCache assumes a GPU beside the host pool. On a CPU-only machine three
things stop it: the host pool asks for pinned memory (which needs a GPU driver), the
``direct`` host<->device copy op (``transfer_kv_direct``) comes from the CUDA kernel wheel, and the
cache controller calls ``synchronize()`` on its streams, which ``torch.cpu.Stream`` lacks. This
plugin creates the host pool unpinned, copies with ``index_select``/``index_copy_``, and gives the
CPU stream a ``synchronize`` that returns at once (CPU copies are done when they return). It is
found through the ``sglang.srt.plugins`` entry point of the ``*.dist-info`` beside it, which the
test ring puts on ``PYTHONPATH``; it is never installed. SGLang on CPU is a test setup only.
"""

from __future__ import annotations


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size) -> None:
    import torch

    src = src_indices.to(torch.int64)
    dst = dst_indices.to(torch.int64)
    for s, d in zip(src_layers, dst_layers, strict=True):
        d.index_copy_(0, dst.to(d.device), s.index_select(0, src.to(s.device)).to(d.device))


def install() -> None:
    import torch

    if torch.cuda.is_available():
        return  # a GPU machine runs SGLang's own ops

    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None

    from sglang.srt.mem_cache.pool_host import base, mha

    mha.transfer_kv_direct = _transfer_kv_direct
    if not getattr(base.HostKVCache.__init__, "_tpcache_unpinned", False):
        original = base.HostKVCache.__init__

        def unpinned_init(self, *args, **kwargs):
            kwargs["pin_memory"] = False
            original(self, *args, **kwargs)

        unpinned_init._tpcache_unpinned = True
        base.HostKVCache.__init__ = unpinned_init

"""The data plane: inline pages, and a client's shared-memory KV buffers registered per rank."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

import protocol as p
from tests.service.harness import running_service
from tpcache.service.buffers import ShmKVBuffer, cuda_ipc_descriptor
from tpcache.service.config import parse_kv_layout

pytestmark = pytest.mark.multiprocess

LAYOUT = "L2xH2xD4:fp32"
PAGE, PAGES = 4, 16


def test_inline_pages_and_registered_shm_buffers(tmp_path: Path) -> None:
    layout = parse_kv_layout(LAYOUT, PAGE)
    size = layout.page_bytes
    args = ("--page-size", str(PAGE), "--device-pages", str(PAGES), "--host-pages", "16", "--kv-layout", LAYOUT)
    tag = uuid.uuid4().hex[:8]
    buffers = [ShmKVBuffer(f"tpcache-test-kv-{tag}-{r}", layout, PAGES) for r in range(2)]
    try:
        with running_service(tmp_path, *args) as service, service.client() as c:
            assert c.info.layout == LAYOUT
            # Inline: every rank's share, rank-major, written into the lease's pages and read back exactly.
            lk = c.lock(list(range(100, 108)))
            mine = list(c.alloc(lk.lease, 2).device_page_ids)
            data = os.urandom(2 * 2 * size)
            assert c.put_pages(mine, data, lease=lk.lease).written_pages == 2
            assert c.get_pages(mine, lease=lk.lease).data == data
            with pytest.raises(p.InvalidArgument):
                c.put_pages(mine[:1], data, lease=lk.lease)  # wrong size for one page
            with pytest.raises(p.InvalidArgument):
                c.get_pages([PAGES], lease=lk.lease)  # out of range
            # Cached bytes never change through the protocol; only agreed or own pages are read.
            c.insert(list(range(100, 108)), mine, lease=lk.lease)
            c.release(lk.lease)
            assert c.get_pages(mine).data == data  # cached and agreed: readable by anyone
            other = c.lock(list(range(300, 304)))
            theirs = list(c.alloc(other.lease, 1).device_page_ids)
            with pytest.raises(p.InvalidArgument, match="not a page lease"):
                c.put_pages(mine[:1], os.urandom(2 * size), lease=other.lease)  # a cached page
            with pytest.raises(p.InvalidArgument, match="give that lease"):
                c.put_pages(theirs, os.urandom(2 * size))  # no lease
            with service.client() as stranger:
                with pytest.raises(p.NotFound):
                    stranger.put_pages(theirs, os.urandom(2 * size), lease=other.lease)
                with pytest.raises(p.InvalidArgument, match="neither cached"):
                    stranger.get_pages(theirs)  # another client's page, not inserted
            free = sorted(set(range(PAGES)) - set(mine) - set(theirs))[:1]
            with pytest.raises(p.InvalidArgument, match="neither cached"):
                c.get_pages(free)
            assert c.get_pages(mine).data == data
            c.abort(other.lease)
            c.flush()  # registration needs an empty cache
            # A bad descriptor on one rank: refused with that rank named, nothing swapped.
            bad = [buffers[0].descriptor(0), {"rank": 1, "kind": "shm", "name": "no-such-seg", "pages": PAGES}]
            with pytest.raises(p.InvalidArgument, match="rank 1"):
                c.register_buffers(bad)
            # Register the client's own buffers: the ranks now read and write the client's memory.
            assert c.register_buffers([b.descriptor(r) for r, b in enumerate(buffers)]).registered == 2
            fresh = os.urandom(2 * size)
            lk = c.lock(list(range(200, 204)))
            page_no = c.alloc(lk.lease, 1).device_page_ids[0]
            c.put_pages([page_no], fresh, lease=lk.lease)
            for r, buf in enumerate(buffers):
                page = buf.tensor[:, :, page_no].contiguous().view(torch.uint8).reshape(-1)
                assert bytes(page.numpy()) == fresh[r * size : (r + 1) * size]
            buffers[1].tensor[:, :, page_no] = 1.5  # the client writes KV; the service sees it
            got = c.get_pages([page_no], lease=lk.lease).data
            assert torch.frombuffer(bytearray(got[size:]), dtype=torch.float32).eq(1.5).all()
            c.abort(lk.lease)
            # Registration swaps pools only while the cache is empty.
            lk = c.lock(list(range(8)))
            c.insert(list(range(8)), c.alloc(lk.lease, 2).device_page_ids, lease=lk.lease)
            with pytest.raises(p.InvalidArgument, match="not empty"):
                c.register_buffers([b.descriptor(r) for r, b in enumerate(buffers)])
            stats = c.stats().values
            assert stats["digests_equal"] is True and stats["rank0.closed"] == 0
    finally:
        for buf in buffers:
            buf.close()


@pytest.mark.gpu
def test_cuda_ipc_descriptor_round_trip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tpcache.service.buffers import stage_buffer

    layout = parse_kv_layout(LAYOUT, PAGE)
    tensor = torch.zeros((2, 2, PAGES, PAGE, 2, 4), dtype=torch.float32, device="cuda")
    desc = cuda_ipc_descriptor(tensor, rank=0, pages=PAGES)
    staged = stage_buffer(desc, layout, PAGES)  # same process: the handle maps the same memory
    staged.pool.kv[0, 0, 1].fill_(3.0)
    torch.cuda.synchronize()
    assert tensor[0, 0, 1].eq(3.0).all()
    staged.close()

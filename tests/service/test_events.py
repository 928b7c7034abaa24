"""The KV-event stream of a running service: rank 0 of a two-rank group with host and storage
tiers publishes what every round changed; the reference subscriber's mirror passes every digest
and answers what the cache answers; a plain ZMQ SUB socket decodes every batch with the installed
vLLM's own ``KVEventBatch`` decoder and sees contiguous sequence numbers; a flush reads as all
cleared."""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import pytest
import zmq

import protocol as p
from tests.service.harness import running_service
from tpcache.events import Subscriber, wire

pytestmark = pytest.mark.multiprocess

P = 4


def _settle(sub: Subscriber, plain: zmq.Socket, seen: list[tuple[int, bytes]], quiet_s: float = 1.0) -> None:
    """Read until nothing arrived for ``quiet_s`` (the cache is idle: every copy landed)."""
    last = time.monotonic()
    while time.monotonic() - last < quiet_s:
        got = sub.poll(0.05)
        while plain.poll(0):
            topic, seq8, payload = plain.recv_multipart()
            seen.append((wire.seq_of(seq8), payload))
            got += 1
        if got:
            last = time.monotonic()


def test_a_service_streams_what_its_cache_holds(tmp_path: Path) -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    args = (
        *("--page-size", str(P), "--device-pages", "16", "--host-pages", "24", "--kv-layout", "L1xH1xD4:fp32"),
        *("--storage-dir", str(tmp_path / "storage"), "--write-policy", "write_through", "--heartbeat-s", "0.2"),
        *("--events-endpoint", "0", "--events-digest-every", "2", "--events-model", "tiny"),
        *("--events-replay-batches", "30", "--events-batch-ms", "0"),
    )
    with running_service(tmp_path / "svc", *args) as svc:
        info = svc.info["events"]
        assert info["endpoint"].startswith("tcp://127.0.0.1:") and info["replay_endpoint"].startswith(
            "tcp://127.0.0.1:"
        )
        assert (info["model"], info["tp_size"], info["pp_size"], info["page_size"]) == ("tiny", 2, 1, P)
        plain = zmq.Context.instance().socket(zmq.SUB)
        plain.setsockopt(zmq.LINGER, 0)
        plain.setsockopt(zmq.SUBSCRIBE, info["topic"].encode())
        plain.connect(info["endpoint"])
        sub = Subscriber()
        group = sub.follow(info["endpoint"], info["replay_endpoint"])
        seen: list[tuple[int, bytes]] = []
        _settle(sub, plain, seen, quiet_s=0.3)  # both subscriptions reach the publisher
        c = svc.client()
        rng = random.Random(7)
        prompts = []
        restarted = Subscriber()
        for n in range(60):
            if n == 20:  # a router stops, keeping its mirror; it comes back 3 requests later
                kept = restarted.follow(info["endpoint"], info["replay_endpoint"])
                restarted.close()
            if n == 23:
                back = restarted.follow(info["endpoint"], info["replay_endpoint"], resume=kept)
                assert back.counters["replayed"] >= 1 and back.counters["resyncs"] == 0
            depth = rng.randint(1, 5)
            tokens = [rng.randrange(3) * 100 + d * 1000 + i for d in range(depth) for i in range(P)]
            prompts.append(tokens)
            lk = c.lock(tokens, prefetch="none")
            have = list(c.match(tokens).device_page_ids)
            lk_pages = lk.hit_tokens // P
            if len(have) == lk_pages < depth:  # (a host hit would need a load first: insert after device hits)
                with contextlib.suppress(p.NoSpace):  # device pages still being backed up: skip this one
                    new = list(c.alloc(lk.lease, depth - lk_pages).device_page_ids)
                    c.insert(tokens, have + new, lease=lk.lease)
            c.release(lk.lease)
            sub.poll(0)
        _settle(sub, plain, seen)
        late = Subscriber()  # joins after more batches than the ring keeps: a snapshot
        joined = late.follow(info["endpoint"], info["replay_endpoint"])
        assert joined.counters["resyncs"] == 1 and joined.tiers == group.tiers and joined.seq == group.seq
        late.close()
        restarted.poll(0.5)
        assert back.tiers == group.tiers

        counts = group.counters
        assert counts["digests_checked"] >= 10 and counts["digest_mismatches"] == 0 and counts["resyncs"] == 0
        assert all(group.tiers), "pages on device, host and storage were published"
        for tokens in prompts:  # the mirror answers what the cache answers
            m = c.match(tokens)
            lead = group.leading_pages(tokens)
            assert lead["device"] == m.device_pages
            dev, host, _ = group.tiers
            resident = 0
            hashes = wire_hashes(tokens, group.identity["namespace"])
            while resident < len(hashes) and (hashes[resident] in dev or hashes[resident] in host):
                resident += 1
            assert resident == m.device_pages + m.host_pages

        decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
        seqs = [s for s, _ in seen]
        assert len(seqs) >= 20 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        mediums = set()
        for _, payload in seen:
            batch = decoder.decode(payload)
            for ev in batch.events:
                assert isinstance(ev, kv_events.BlockStored | kv_events.BlockRemoved | kv_events.AllBlocksCleared)
                if not isinstance(ev, kv_events.AllBlocksCleared):
                    mediums.add(ev.medium)
        assert mediums == {"GPU", "CPU", "STORAGE"}

        c.flush()
        _settle(sub, plain, seen)
        last = decoder.decode(seen[-1][1]) if seen else None
        assert group.tiers == (set(), set(), set())
        assert last is not None and any(isinstance(ev, kv_events.AllBlocksCleared) for ev in last.events)
        sub.close()
        plain.close(0)
        c.close()


def wire_hashes(tokens: list[int], namespace: str) -> list[int]:
    from tpcache.core.hashing import as_token_bytes, hash_chain

    return hash_chain(as_token_bytes(tokens), P, namespace)

"""The event stream between a publisher fed by a real core and the reference subscriber, in one
process over loopback TCP: the mirror equals the cache's tiers after every batch and at every
digest; a restarted subscriber catches up by replay; one past the replay window resynchronises
from a snapshot; a late joiner converges; a mirror that went wrong is caught by the next digest;
two groups stay apart; a group that restarts (a new incarnation) is followed from scratch."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
import zmq

from tpcache.core import CacheConfig, CacheCore
from tpcache.core.treecore.feed import ChangeFeed, on_tiers
from tpcache.events import Group, Subscriber, wire
from tpcache.events.publisher import EventPublisher
from tpcache.replay import drain as replay_drain

P = 4


class Stream:
    """A core whose change feed a publisher publishes after every step (what rank 0 does)."""

    def __init__(
        self,
        namespace: str = "",
        replay_batches: int = 10_000,
        endpoints: tuple[str, str] | None = None,
        batch_s: float = 0.0,
        replay_bytes: int = 64 << 20,
        hwm: int = 100_000,
    ):
        config = CacheConfig(
            page_size=P, device_pages=10, host_pages=14, write_policy="write_through", storage=True, namespace=namespace
        )
        self.core = CacheCore(config)
        self.core.ledger.feed = self.feed = ChangeFeed()
        self.rng = random.Random(namespace)
        pub, replay = endpoints or ("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        identity = {"model": "m", "namespace": namespace, "incarnation": random.getrandbits(63)}
        identity.update(tp_size=2, pp_size=1, page_size=P)
        self.pub = EventPublisher(
            zmq.Context.instance(),
            pub,
            replay,
            identity,
            page_size=P,
            replay_batches=replay_batches,
            digest_every=3,
            batch_s=batch_s,
            replay_bytes=replay_bytes,
            hwm=hwm,
        )
        self.prompts: list[list[int]] = []

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            depth = self.rng.randint(1, 5)
            tokens = [self.rng.randrange(3) * 10 + d * 1000 + i for d in range(depth) for i in range(P)]
            self.prompts.append(tokens)
            lease, m = self.core.lock(tokens)
            fresh = self.core.alloc(lease, depth - m.device_pages)
            self.core.insert(lease, tokens, m.device_page_ids + fresh)
            self.core.release(lease)
            replay_drain(self.core)  # the round: copies land, completions apply
            self.pub.publish(self.feed.drain())

    def tiers(self) -> tuple[set[int], set[int], set[int]]:
        return on_tiers(self.core.tree.nodes.values())


@pytest.fixture
def streams() -> Iterator[list[Stream]]:
    made: list[Stream] = []
    yield made
    for s in made:
        s.pub.close()


def follow(sub: Subscriber, s: Stream, resume: Group | None = None) -> Group:
    return sub.follow(s.pub.endpoint, s.pub.replay_endpoint, resume=resume)


def sync(sub: Subscriber, g: Group, s: Stream) -> None:
    deadline = time.monotonic() + 20
    while g.seq < s.pub.seq:
        assert time.monotonic() < deadline, f"the subscriber is at batch {g.seq}, the stream at {s.pub.seq}"
        sub.poll(0.05)


def test_the_mirror_equals_the_cache_after_every_batch_and_every_digest_checks(streams):
    s = Stream()
    streams.append(s)
    sub = Subscriber()
    g = follow(sub, s)
    for _ in range(40):
        s.step()
        sync(sub, g, s)
        assert g.tiers == s.tiers()
    assert all(s.tiers()), "every tier held pages"
    assert s.pub.counters["event_pages_removed"] > 0  # evictions were published
    assert g.counters["digests_checked"] >= 10 and g.counters["digest_mismatches"] == 0
    assert g.counters["resyncs"] == 0
    last = s.prompts[-1]
    assert g.leading_pages(last)["any"] == len(last) // P  # the last request's pages are cached
    sub.close()


def test_a_restarted_subscriber_catches_up_by_replay(streams):
    s = Stream()
    streams.append(s)
    sub = Subscriber()
    g = follow(sub, s)
    s.step(5)
    sync(sub, g, s)
    sub.close()  # the router goes away, keeping its mirror
    s.step(20)
    missed = s.pub.seq - g.seq
    sub = Subscriber()
    again = follow(sub, s, resume=g)
    assert missed >= 10 and again.counters["replayed"] == missed and again.counters["resyncs"] == 0
    assert again.seq == s.pub.seq and again.tiers == s.tiers()
    sub.close()


def test_a_subscriber_past_the_replay_window_resynchronises_from_a_snapshot(streams):
    s = Stream(replay_batches=8)
    streams.append(s)
    sub = Subscriber()
    g = follow(sub, s)
    s.step(3)
    sync(sub, g, s)
    sub.close()
    s.step(30)
    sub = Subscriber()
    again = follow(sub, s, resume=g)
    assert again.counters["resyncs"] == 1
    assert again.seq == s.pub.seq and again.tiers == s.tiers()
    s.step(5)  # and it follows the live stream from there
    sync(sub, again, s)
    assert again.tiers == s.tiers()
    sub.close()


def test_a_late_joiner_converges(streams):
    s = Stream(replay_batches=8)
    streams.append(s)
    s.step(30)
    sub = Subscriber()
    g = follow(sub, s)
    assert g.counters["resyncs"] == 1 and g.tiers == s.tiers()
    s.step(10)
    sync(sub, g, s)
    assert g.tiers == s.tiers()
    sub.close()


def test_a_mirror_that_went_wrong_is_caught_by_the_next_digest(streams):
    s = Stream()
    streams.append(s)
    sub = Subscriber()
    g = follow(sub, s)
    s.step(5)
    sync(sub, g, s)
    h = next(iter(g.tiers[0]))
    g.tiers[0].discard(h)  # as if a removal had been applied that never happened
    g.digest = (g.digest - wire.pair_term(h, 0)) & wire.MASK
    s.step(6)  # two digests later at most
    sync(sub, g, s)
    assert g.counters["digest_mismatches"] >= 1 and g.counters["resyncs"] >= 1
    assert g.tiers == s.tiers()
    sub.close()


def test_two_groups_on_one_subscriber_stay_apart(streams):
    a, b = Stream(namespace="a"), Stream(namespace="b")
    streams += [a, b]
    sub = Subscriber()
    ga, gb = follow(sub, a), follow(sub, b)
    for _ in range(10):
        a.step()
        b.step(2)
    sync(sub, ga, a)
    sync(sub, gb, b)
    assert ga.incarnation != gb.incarnation
    assert ga.tiers == a.tiers() and gb.tiers == b.tiers()
    assert not (ga.pages() & gb.pages())  # namespaces salt the hashes: nothing shared
    prompt = a.prompts[-1]
    assert ga.leading_pages(prompt)["any"] == len(prompt) // P and gb.leading_pages(prompt)["any"] == 0
    sub.close()


def test_a_group_that_restarts_is_followed_from_its_new_incarnation(streams):
    first = Stream()
    streams.append(first)
    endpoints = (first.pub.endpoint, first.pub.replay_endpoint)
    sub = Subscriber()
    g = follow(sub, first)
    first.step(12)
    sync(sub, g, first)
    old = g.incarnation
    first.pub.close()
    streams.remove(first)
    deadline = time.monotonic() + 20
    while True:  # the same addresses (free again once ZMQ's I/O thread has closed them), an empty cache
        try:
            second = Stream(namespace="", endpoints=endpoints)
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    streams.append(second)
    second.rng.seed(99)
    deadline = time.monotonic() + 20
    while g.incarnation == old or g.seq < second.pub.seq or g.tiers != second.tiers():
        assert time.monotonic() < deadline, (g.counters, g.seq, second.pub.seq)
        second.step()
        sub.poll(0.05)
    assert g.counters["incarnations"] >= 1
    sub.close()


def test_a_slow_subscriber_loses_batches_without_holding_up_a_round_and_replays_them(streams):
    # inproc: no kernel buffer behind ZMQ's queues, so the high-water marks alone decide the drops.
    s = Stream(endpoints=("inproc://slow-events", "inproc://slow-replay"), hwm=4)
    streams.append(s)
    sub = Subscriber(rcvhwm=4)
    g = follow(sub, s)
    s.step(80)  # the subscriber reads nothing meanwhile: the PUB socket drops what does not fit
    assert s.pub.seq >= 40
    sync(sub, g, s)
    assert g.counters["gaps"] >= 1 and g.counters["replayed"] >= 20  # lost batches seen, then replayed
    assert s.pub.counters["event_replays"] >= 2
    assert g.tiers == s.tiers() and g.counters["digest_mismatches"] == 0 and g.counters["resyncs"] == 0
    sub.close()


def test_the_replay_ring_is_bounded_by_batches_and_by_bytes(streams):
    by_count, by_bytes = Stream(replay_batches=8), Stream(replay_bytes=3000)
    streams += [by_count, by_bytes]
    for s in (by_count, by_bytes):
        s.step(60)
        ring = s.pub.ring
        assert [seq for seq, _ in ring] == list(range(s.pub.seq - len(ring) + 1, s.pub.seq + 1))  # the newest
        assert s.pub.ring_bytes == sum(len(p) for _, p in ring)
        assert s.pub.counters["event_ring_dropped_batches"] == s.pub.seq + 1 - len(ring) > 0
    assert len(by_count.pub.ring) == 8
    assert by_bytes.pub.ring_bytes <= 3000 < by_bytes.pub.ring_bytes + len(by_bytes.pub.ring[0][1]) * 2


def test_the_digest_terms_and_the_batch_encoding_match_their_references():
    rng = random.Random(5)
    hashes = [0, 1, (1 << 64) - 1] + [rng.getrandbits(64) for _ in range(100)]
    for tier in (0, 1, 2):
        assert wire.pair_sum(hashes, tier) == wire.reference_pair_sum(hashes, tier)
        assert wire.pair_sum(hashes[:1], tier) == wire.pair_term(0, tier)
    assert wire.pair_sum([], 0) == 0
    enc = wire.BatchEncoder(page_size=16)
    for n in (0, 1, 15, 16, 70_000):  # msgpack's array headers change at 16 and 65,536 items
        some = hashes[:n] if n <= len(hashes) else list(range(n))
        events = [wire.CLEARED, wire.removed_event(some, 1), wire.stored_event(some, 2, 16)]
        made = enc.batch(12.5, [enc.cleared, enc.removed(some, 1), enc.stored(some, 2)])
        assert made == wire.encode_batch(12.5, events)
        assert wire.decode_batch(made) == events


def test_the_page_hash_and_the_digest_keep_their_documented_values():
    from tpcache.core.hashing import as_token_bytes, hash_chain

    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert hash_chain(as_token_bytes(tokens), 4, "") == [9564278882950974937, 4776551355992039541]
    assert hash_chain(as_token_bytes(tokens), 4, "llama-3-8b") == [2915114071343900636, 10571369670382152602]
    assert wire.digest_of(([1, 2], [3], [])) == 11354718384610661277


def test_event_settings_are_checked_and_off_by_default():
    from tpcache.service.config import ConfigError, ServiceConfig, build_config, events_endpoints

    assert events_endpoints(ServiceConfig()) == ("", "")
    on = build_config(cli={"events_endpoint": "5557"}, env={})
    assert events_endpoints(on) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")  # loopback unless named
    named = build_config(cli={"events_endpoint": "tcp://0.0.0.0:0"}, env={})
    assert events_endpoints(named) == ("tcp://0.0.0.0:0", "tcp://0.0.0.0:0")
    for cli, name in (
        ({"events_endpoint": "udp://x"}, "events_endpoint"),
        ({"events_endpoint": "5557", "events_topic": "tpcache"}, "events_topic"),
        ({"events_replay_endpoint": "5558"}, "events_replay_endpoint"),
        ({"events_endpoint": "5557", "events_replay_batches": 0}, "events_replay_batches"),
    ):
        with pytest.raises(ConfigError, match=name.replace("_", "[-_]")):
            build_config(cli=cli, env={})


def test_rounds_close_together_share_a_batch_in_their_order(streams):
    s = Stream(batch_s=3600.0)  # no batch falls due by itself: tick(0) after time has passed does it
    streams.append(s)
    sub = Subscriber()
    g = follow(sub, s)
    before = s.pub.seq
    s.step(12)  # rounds that store pages and evict them again
    assert s.pub.seq == before and len(s.pub.pending) >= 6
    assert s.pub.tick(100) <= 100
    s.pub.batch_s = 0.0
    assert s.pub.tick(100) == 100 and not s.pub.pending
    assert s.pub.seq == before + 1  # one batch for all of them
    sync(sub, g, s)
    assert g.tiers == s.tiers()
    sub.close()


class FragilePublisher(EventPublisher):
    """A publisher one request of which fails inside its answer (as a bug in one answer would)."""

    def _answer(self, frames: list[bytes]) -> None:
        if frames[-1] == b"fails":
            raise ValueError("this request fails")
        super()._answer(frames)


def test_a_request_that_fails_does_not_stop_later_replays():
    identity = {"model": "m", "namespace": "", "incarnation": 1, "tp_size": 1, "pp_size": 1, "page_size": P}
    ctx = zmq.Context.instance()
    pub = FragilePublisher(ctx, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", identity, page_size=P)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        # Malformed requests (wrong frame counts, unknown requests) and one whose answer fails.
        for frames in ([b"x"], [b"", b"a", b"b"], [b"", b"1234567"], [b"", b"fails"], [b"", b""]):
            dealer.send_multipart(frames)
        dealer.send_multipart((b"", wire.seq_bytes(0)))  # a replay from batch 0
        assert dealer.poll(10_000), "the replay thread stopped answering"
        _, topic, seq, _ = dealer.recv_multipart()
        assert topic == pub.topic and seq == wire.seq_bytes(0)
        assert dealer.poll(10_000) and dealer.recv_multipart() == [b"", b"", wire.END_SEQ, b""]
    finally:
        dealer.close(0)
        pub.close()
    assert pub.router.closed and not pub._thread.is_alive()

"""Rank 0 applies plain lookups as it reads them (also while a round waits for the followers):
each one still sees exactly what was sent before it on its connection, whatever the batches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

import protocol as p
from tests.service.checks import cache_round_trip, fresh_tokens
from tests.service.harness import Service

LOOKUPS = 300  # on each side of the insert: enough that the burst spans several batches and rounds


def call(sock: zmq.Socket, rid: int, body: p.Body) -> Any:
    sock.send(p.encode_request(p.Request(rid, body)))
    assert sock.poll(30_000), "no reply"
    response = p.decode_response(sock.recv())
    assert response.id == rid
    return response.unwrap()


def test_a_burst_of_lookups_around_an_insert_sees_it_exactly_after(service: Service) -> None:
    burst(service)
    cache_round_trip(service)


def test_bursts_from_several_connections_at_once(service: Service) -> None:
    """Other connections' frames arrive while rank 0 reads and while its rounds wait: each
    connection's order holds all the same."""
    with ThreadPoolExecutor(4) as pool:
        for done in [pool.submit(burst, service, 150) for _ in range(8)]:
            done.result()
    cache_round_trip(service)


def burst(service: Service, lookups: int = LOOKUPS) -> None:
    """On one connection, without waiting: ``lookups`` matches, an insert of their tokens, as many
    matches again, a release. The first ones miss, the others hit exactly the inserted pages."""
    with service.client() as c:
        page = c.info.page_size
    tokens = fresh_tokens(4 * page)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)  # leases belong to a connection: this one takes and uses it
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.endpoint)
    try:
        lease = call(sock, 10_001, p.LockRequest(tokens=tokens)).lease
        pages = list(call(sock, 10_002, p.AllocRequest(lease, 4)).device_page_ids)
        frames = [p.encode_request(p.Request(i, p.MatchRequest(tokens=tokens))) for i in range(lookups)]
        insert = p.InsertRequest(tokens=tokens, device_page_ids=pages, lease=lease)
        frames.append(p.encode_request(p.Request(lookups, insert)))
        frames += [
            p.encode_request(p.Request(i, p.MatchRequest(tokens=tokens))) for i in range(lookups + 1, 2 * lookups + 1)
        ]
        frames.append(p.encode_request(p.Request(2 * lookups + 1, p.ReleaseRequest(lease))))
        for frame in frames:
            sock.send(frame)
        replies: dict[int, p.Response] = {}
        while len(replies) < len(frames):
            assert sock.poll(30_000), f"{len(replies)} of {len(frames)} replies"
            response = p.decode_response(sock.recv())
            assert response.id is not None and response.id not in replies
            replies[response.id] = response
    finally:
        sock.close()
    assert replies[lookups].unwrap().inserted_pages == 4
    for i in range(lookups):
        assert replies[i].unwrap().hit_tokens == 0, i  # sent before the insert
    for i in range(lookups + 1, 2 * lookups + 1):
        hit = replies[i].unwrap()
        assert (hit.hit_tokens, list(hit.device_page_ids)) == (4 * page, pages), i  # sent after it
    replies[2 * lookups + 1].unwrap()


def test_lookups_behind_envelope_frames_are_answered_behind_them(service: Service) -> None:
    """A client whose requests carry envelope frames (a REQ socket's empty delimiter; sent here by a
    DEALER, so that many are in flight at once) gets every lookup's reply behind the same frames,
    among replies sent back to back; a REQ socket, one request at a time, too."""
    with service.client() as c:
        page = c.info.page_size
    tokens = fresh_tokens(2 * page)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.endpoint)
    try:
        for i in range(200):
            sock.send_multipart([b"", p.encode_request(p.Request(i, p.MatchRequest(tokens=tokens)))])
        seen = set()
        while len(seen) < 200:
            assert sock.poll(30_000), f"{len(seen)} of 200 replies"
            delimiter, frame = sock.recv_multipart()
            response = p.decode_response(frame)
            assert delimiter == b"" and response.id not in seen
            assert response.unwrap().hit_tokens == 0
            seen.add(response.id)
    finally:
        sock.close()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(service.endpoint)
    try:
        for i in range(3):
            assert call(req, i, p.MatchRequest(tokens=tokens)).hit_tokens == 0
    finally:
        req.close()

"""The service routes each op as the message catalogue declares it, and serves every op it lists."""

from __future__ import annotations

import protocol as p
from tpcache.service.ops import OPS


def test_every_op_in_the_catalogue_has_one_handler() -> None:
    assert sorted(OPS) == sorted(p.REQUEST_TYPES)
    for op, body in p.REQUEST_TYPES.items():
        assert body.ROUTE in p.messages.ROUTES, op
        if body.ROUTE == p.GATHERED:
            # a follower's answer and the leader's join are part of a gathered op's handler
            assert OPS[op].payload is not None and OPS[op].merge is not None, op


def test_routes_of_the_catalogue() -> None:
    local = {op for op, body in p.REQUEST_TYPES.items() if body.ROUTE == p.LOCAL}
    gathered = {op for op, body in p.REQUEST_TYPES.items() if body.ROUTE == p.GATHERED}
    assert local == {"hello", "match", "health"}
    assert gathered == {"stats", "register_buffers", "put_pages", "get_pages"}

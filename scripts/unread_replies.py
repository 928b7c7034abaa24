"""How a service holds up when many clients leave their replies unread: each episode, 64
connections each send 24 ``get_pages`` (256 KiB replies) and read nothing; a new client connects
(its ``hello``) while they hold them. Prints per episode the slowest ``hello``, each rank's peak
resident memory above its start, and what stays once the connections left (freed memory is handed
back to the OS, so it should not grow from episode to episode).

Usage: ``python scripts/unread_replies.py [--bound-mib 32] [--episodes 5] [--connections 64]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import protocol as p  # noqa: E402
from tests.service.harness import running_service, wait_for  # noqa: E402
from tests.service.test_memory import LAYOUT, MiB, _stored_pages, non_reader, rss  # noqa: E402
from tpcache.client import Client  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bound-mib", type=int, default=32, help="--max-unread-reply-bytes, in MiB")
    ap.add_argument("--episodes", type=int, default=5)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--requests", type=int, default=24, help="get_pages each connection sends")
    args = ap.parse_args()
    opts = ("--page-size", "4", "--device-pages", "64", "--kv-layout", LAYOUT, "--heartbeat", "0.2")
    opts += ("--max-unread-reply-bytes", f"{args.bound_mib}MiB")
    with running_service(Path(tempfile.mkdtemp(prefix="unread-")), *opts) as service, service.client() as c:
        pages = _stored_pages(c)
        before = [rss(pid) for pid in service.pids]
        body = p.GetPagesRequest(page_ids=pages)
        frames = [p.encode_request(p.Request(i, body)) for i in range(1, args.requests + 1)]
        for episode in range(args.episodes):
            received = c.stats().values["requests_received"]
            socks = [non_reader(service.endpoint) for _ in range(args.connections)]
            for sock in socks:
                for frame in frames:
                    sock.send(frame)
            peak = list(before)
            hellos = []
            want = received + args.connections * args.requests
            while True:
                start = time.monotonic()
                Client(service.endpoint, timeout_s=10.0).close()  # connect and say hello
                hellos.append(time.monotonic() - start)
                peak = [max(m, rss(pid)) for m, pid in zip(peak, service.pids, strict=True)]
                if c.stats().values["requests_received"] >= want + len(hellos):
                    break
            for sock in socks:
                sock.close()
            wait_for(lambda: c.stats().values["unread_reply_bytes"] < 64 * 1024, 30)
            time.sleep(1.5)
            after = [(rss(pid) - b) / MiB for pid, b in zip(service.pids, before, strict=True)]
            peaks = [(m - b) / MiB for m, b in zip(peak, before, strict=True)]
            print(
                f"episode {episode}: slowest hello {max(hellos) * 1000:.0f} ms ({len(hellos)} tried); "
                f"peak RSS above start per rank {[f'{x:.1f}' for x in peaks]} MiB; "
                f"after {[f'{x:.1f}' for x in after]} MiB",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The service's client: start a service, then run this against it.

    python -m launcher local --nproc 2 &     # serves on tcp://127.0.0.1:5555
    python examples/client.py [ENDPOINT]

docs/guides/service.md shows this file from the first import on (tests/launcher/test_examples.py checks that
they are the same and runs it).
"""

import sys

from tpcache import Client

endpoint = sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5555"
prompt = list(range(1000))  # one request's token ids
with Client(endpoint, timeout_s=5) as c:  # typed results; protocol errors raise typed exceptions
    full_pages = len(prompt) // c.info.page_size  # a partial last page is never cached
    for turn in range(2):
        lock = c.lock(prompt)  # match + pin the cached prefix under a lease; with storage, look the rest up
        pages = c.hit_pages(lock)  # the hit on device (host and storage hits loaded back), readable now
        missing = full_pages - len(pages)
        fresh = list(c.alloc(lock.lease, missing).device_page_ids) if missing else []
        # ... the engine computes the new tokens' KV into `fresh` ...
        c.insert(prompt, pages + fresh, lock.lease)
        c.release(lock.lease)
        print(f"turn {turn}: {len(pages) * c.info.page_size} of {len(prompt)} tokens hit")
    print(c.health(), "equal digests:", c.stats().values["digests_equal"])

"""The core's sequenced operations for an engine that owns its device KV (the work is in ``external.py``).

Two ways an engine's pages meet the core:

- vLLM keeps its own block pool: the core has no device tier, ``save`` backs pages up from the
  engine's blocks into host slots and ``load_into`` copies a lease's hit into the blocks it names;
- SGLang lends its KV pool as the core's device tier (``device_adopt``): ``adopt`` takes a request's
  pages into the tree, and the pages the core frees wait in ``drain_returned`` for the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tpcache.core.hashing import TokenIds, as_token_bytes
from tpcache.core.records import Lease, Transfer

if TYPE_CHECKING:
    from tpcache.core.external import EnginePages


class EngineOps:
    """Mixed into ``CacheCore``: these read only what ``CacheCore`` sets up."""

    engine_pages: EnginePages

    def _engine_op(self, lease_id: int, blocks: list[int]) -> tuple[Lease, list[int]]:
        raise NotImplementedError  # CacheCore's

    def save(self, lease_id: int, tokens: TokenIds, blocks: list[int]) -> Transfer | None:
        """Engine-owned device pages: back up the pages of ``tokens`` the cache lacks from the
        engine's ``blocks`` (``external.py``)."""
        lease, blocks = self._engine_op(lease_id, blocks)
        return self.engine_pages.save(lease, as_token_bytes(tokens), blocks)

    def load_into(self, lease_id: int, first_page: int, blocks: list[int]) -> Transfer | None:
        """Engine-owned device pages: copy pages of the lease's hit into the engine's ``blocks``."""
        lease, blocks = self._engine_op(lease_id, blocks)
        return self.engine_pages.load_into(lease, first_page, blocks)

    def adopt(self, lease_id: int, tokens: TokenIds, pages: Sequence[int]) -> list[int]:
        """With ``device_adopt``: cache the full pages of ``tokens`` whose KV the engine wrote into
        ``pages``; returns the pages not adopted (cached already under other pages), which stay the
        engine's (``EnginePages.adopt``)."""
        return self.engine_pages.adopt(lease_id, tokens, pages)

    def load_adopted(self, lease_id: int, pages: Sequence[int]) -> Transfer | None:
        """With ``device_adopt`` and a host tier: copy the lease's host-only hit into the engine's
        ``pages`` and adopt them there (``EnginePages.load_adopted``)."""
        return self.engine_pages.load_adopted(lease_id, pages)

    def drain_returned(self) -> list[int]:
        """With ``device_adopt``: the device pages freed since the last drain, in the order freed
        (alike on every rank); the engine owns them again."""
        return self.engine_pages.drain()

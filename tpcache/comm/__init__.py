"""The round's collective: one MIN all-reduce per round behind one interface.

Torch-free at import (the simulation ring uses ``SimGroup`` without torch); the torch and shared-memory
transports live in ``tpcache.comm.torch_collective`` and ``tpcache.comm.shm`` and are chosen by
``make_collective``.
"""

from tpcache.comm.collective import (
    Collective,
    CollectiveClosed,
    CollectiveError,
    CollectiveTimeout,
    WrongThreadError,
)
from tpcache.comm.select import TRANSPORTS, make_collective
from tpcache.comm.sim import SimCollective, SimGroup

__all__ = [
    "TRANSPORTS",
    "Collective",
    "CollectiveClosed",
    "CollectiveError",
    "CollectiveTimeout",
    "SimCollective",
    "SimGroup",
    "WrongThreadError",
    "make_collective",
]

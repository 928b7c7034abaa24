"""Faults to inject into one rank of a running vLLM, for tests (``fault_injection`` option).

Each entry names the TP rank it hits; the others behave normally, which is what makes the fault
a disagreement the round has to catch:

- ``{"fail_loads": {"rank": R, "count": N}}``: the first N loads into vLLM's blocks fail on rank R;
- ``{"hold_loads": {"rank": R, "steps": N}}``: rank R reports each load landed only N engine steps
  after it was issued (a slow copy), so requests wait with their loads in flight;
- ``{"scramble_loads": {"rank": R, "count": N}}``: the first N loads on rank R zero the blocks
  they wrote and still report success: a wrong copy no agreement can see, which the tests use to
  show that the model's tokens do depend on the loaded KV (a negative control); with
  ``"group": G``, only the blocks of vLLM's KV cache group G (one component's bytes; ``"sliding"``:
  the sliding-window groups; ``"state"``: the Mamba groups' state blocks);
- ``{"delay_copies": {"rank": R, "seconds": T}}``: rank R's copy thread sleeps T seconds before
  each layer it copies (a slow copy within a step), and checks the bytes of every copy once it
  landed: a load's layer before vLLM's forward pass reads it, a save before the step ends (the
  transfer's ``checked_layers`` and ``check_failures`` counters);
- ``{"diverge": {"rank": R, "step": S}}``: S engine steps after arming, rank R applies one
  operation the other ranks do not (an extra lookup), so the ranks' trees differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tpcache.io.engine_kv import EngineKV
from tpcache.io.transfer import H2D
from tpcache.service.config import ConfigError

KNOWN = {
    "fail_loads": ("rank", "count"),
    "hold_loads": ("rank", "steps"),
    "diverge": ("rank", "step"),
    "scramble_loads": ("rank", "count"),
    "delay_copies": ("rank", "seconds"),
}
OPTIONAL = {"scramble_loads": ("group",)}


class InjectedFault(RuntimeError):
    """A copy failed because a test asked it to."""


class FaultPlan:
    def __init__(self, spec: Mapping[str, Any], rank: int) -> None:
        self.rank = rank
        self.kv: EngineKV | None = None  # the engine's blocks, for scramble_loads
        self.transfer: Any = None  # the engine's transfer (EngineTransfer), for delay_copies
        self.step = 0  # the worker's engine step, advanced by the worker
        self.arm(spec)

    def arm(self, spec: Mapping[str, Any]) -> None:
        """Replace the faults (between engine steps, on every worker alike)."""
        for name, args in spec.items():
            need, extra = set(KNOWN.get(name, ())), set(OPTIONAL.get(name, ()))
            if name not in KNOWN or not isinstance(args, Mapping) or not need <= set(args) <= need | extra:
                raise ConfigError(f"fault_injection: {name!r} needs {{{', '.join(KNOWN.get(name, ()))}}}, got {args!r}")
        self.spec = {name: dict(args) for name, args in spec.items() if args["rank"] == self.rank}
        if "diverge" in self.spec:
            self.spec["diverge"]["step"] += self.step  # counted from now
        self._failed = 0
        self._scrambled = 0
        self._issued: dict[int, int] = {}  # op id -> step it was issued at
        if self.transfer is not None:
            self.transfer.check = "delay_copies" in self.spec

    def layer_delay(self, direction: str, layer: int) -> float:
        """Seconds the copy thread waits before copying one layer (``delay_copies``)."""
        delay = self.spec.get("delay_copies")
        return float(delay["seconds"]) if delay is not None else 0.0

    def before_copy(self, op_id: int, direction: str) -> None:
        fail = self.spec.get("fail_loads")
        if direction == H2D and fail is not None and self._failed < fail["count"]:
            self._failed += 1
            raise InjectedFault(f"injected load failure on rank {self.rank}")

    def after_copy(self, op_id: int, direction: str, dst: Sequence[int]) -> None:
        scramble = self.spec.get("scramble_loads")
        if direction == H2D and scramble is not None and self._scrambled < scramble["count"] and self.kv is not None:
            self._scrambled += 1
            group = scramble.get("group")
            named = {"sliding": self.kv.nullable, "state": self.kv.states}
            groups = sorted(named[group]) if group in named else None if group is None else [group]
            self.kv.fill(dst, 0.0, groups)

    def hold(self, op_id: int, direction: str) -> bool:
        held = self.spec.get("hold_loads")
        if direction != H2D or held is None:
            return False
        issued = self._issued.setdefault(op_id, self.step)
        return self.step < issued + held["steps"]

    def diverges_now(self) -> bool:
        d = self.spec.get("diverge")
        return d is not None and d["step"] == self.step


def arm_faults(worker: Any, spec: Mapping[str, Any]) -> int:
    """Arm ``spec`` on this vLLM worker's connector (``LLM.collective_rpc(arm_faults, args=(spec,))``,
    which needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). Returns the worker's TP rank."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group().worker
    assert side is not None and side.faults is not None
    side.faults.arm(spec)
    return side.cache.rank

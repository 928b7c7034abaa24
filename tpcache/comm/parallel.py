"""How a cache group's ranks split a model: pipeline stages x context ranks x tensor ranks.

A group of ``pp_size * cp_size * tp_size`` ranks holds one tree: every rank keeps the same tree,
applies the same ordered operations and takes part in the same round. What differs is the slice of
each page a rank stores, its ``Shard``: the layers of its pipeline stage (a contiguous share), the
KV heads of its tensor rank (a contiguous share) and, with context parallelism, the tokens of each
page its context rank holds (the engine decides which; every context rank holds the same number).

Global rank order, the one Megatron-LM and vLLM use (tensor ranks innermost, so a stage's tensor
ranks are neighbours on one host):

    rank = (stage * cp_size + cp_rank) * tp_size + tp_rank

so with PP2 x TP2, ranks 0 and 1 are stage 0 (tensor ranks 0 and 1), ranks 2 and 3 stage 1.

Invariants: a shape's sizes are positive ints; ``place`` and ``Shard.rank`` are inverse. Splits are
even (``KVLayout.from_model`` refuses layers, heads or page tokens that do not divide): every
stage holds the same number of layers, every tensor rank the same number of heads, so every rank's
slice of a page has the same shape and the round's layout check can compare them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

MAX_GROUP_SIZE = 1 << 16


class GroupShapeError(ValueError):
    """A group shape that cannot hold the world or split the model; the message says why."""


def _size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_GROUP_SIZE:
        raise GroupShapeError(f"{name} must be an integer in [1, {MAX_GROUP_SIZE}], got {value!r}")
    return value


class Shard(NamedTuple):
    """The slice of every page one rank holds: tensor rank of ``tp_size`` (its KV heads), pipeline
    stage of ``pp_size`` (its layers), context rank of ``cp_size`` (its tokens of each page).
    ``Shard(r, n)`` is rank r of a plain TP group of n."""

    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def rank(self) -> int:
        """The global rank that holds this shard, in the module's order."""
        return (self.pp_rank * self.cp_size + self.cp_rank) * self.tp_size + self.tp_rank

    @property
    def plain(self) -> bool:
        """Tensor parallelism alone (one stage, one context rank): keys and names as before groups."""
        return self.pp_size == 1 and self.cp_size == 1

    @property
    def label(self) -> str:
        """A filesystem-safe name: ``r0of2`` for plain TP, ``p1of2.r0of2`` with stages."""
        parts = [f"p{self.pp_rank}of{self.pp_size}"] if self.pp_size > 1 else []
        parts += [f"c{self.cp_rank}of{self.cp_size}"] if self.cp_size > 1 else []
        return ".".join([*parts, f"r{self.tp_rank}of{self.tp_size}"])


@dataclass(frozen=True)
class ParallelGroup:
    """The shape of a cache group: ``pp_size`` stages, each of ``cp_size`` context ranks of
    ``tp_size`` tensor ranks. ``ParallelGroup(tp_size=n)`` is plain tensor parallelism."""

    pp_size: int = 1
    tp_size: int = 1
    cp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("pp_size", "tp_size", "cp_size"):
            _size(name, getattr(self, name))

    @classmethod
    def of_world(cls, world_size: int, pp_size: int = 1, tp_size: int = 0, cp_size: int = 1) -> ParallelGroup:
        """The shape for ``world_size`` ranks; ``tp_size`` 0 takes what the other sizes leave.
        Raises GroupShapeError when the sizes do not multiply to the world size."""
        _size("world size", world_size)
        pp, cp = _size("pp_size", pp_size), _size("cp_size", cp_size)
        if tp_size == 0:
            if world_size % (pp * cp):
                raise GroupShapeError(
                    f"{world_size} ranks cannot form {pp} pipeline stage(s) x {cp} context rank(s) of equal "
                    f"tensor groups; the world size must be a multiple of {pp * cp}"
                )
            tp_size = world_size // (pp * cp)
        group = cls(pp, tp_size, cp)
        if group.world_size != world_size:
            raise GroupShapeError(f"{group.name} needs {group.world_size} ranks, but the world size is {world_size}")
        return group

    @property
    def world_size(self) -> int:
        return self.pp_size * self.cp_size * self.tp_size

    @property
    def name(self) -> str:
        """``PP2xTP2`` (``xCP2`` with context ranks): how logs and the layout check name it."""
        return f"PP{self.pp_size}xTP{self.tp_size}" + (f"xCP{self.cp_size}" if self.cp_size > 1 else "")

    def place(self, rank: int) -> Shard:
        """Which slice rank ``rank`` holds (the module's order)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise GroupShapeError(f"rank {rank!r} is outside {self.name} (ranks 0..{self.world_size - 1})")
        rest, tp_rank = divmod(rank, self.tp_size)
        pp_rank, cp_rank = divmod(rest, self.cp_size)
        return Shard(tp_rank, self.tp_size, pp_rank, self.pp_size, cp_rank, self.cp_size)

    def describe(self, rank: int, layers_per_rank: int | None = None, heads_per_rank: int | None = None) -> str:
        """What rank ``rank`` holds, in words: ``stage 1 of 2 (layers 2-3 of 4), tensor rank 0 of 2
        (KV heads 0-0 of 2)``; without per-rank counts, only the places."""
        s = self.place(rank)
        stage = f"stage {s.pp_rank} of {self.pp_size}"
        tensor = f"tensor rank {s.tp_rank} of {self.tp_size}"
        if layers_per_rank is not None:
            first = s.pp_rank * layers_per_rank
            stage += f" (layers {first}-{first + layers_per_rank - 1} of {layers_per_rank * self.pp_size})"
        if heads_per_rank is not None:
            first = s.tp_rank * heads_per_rank
            tensor += f" (KV heads {first}-{first + heads_per_rank - 1} of {heads_per_rank * self.tp_size})"
        context = f", context rank {s.cp_rank} of {self.cp_size}" if self.cp_size > 1 else ""
        return f"{self.name} rank {rank}: {stage}, {tensor}{context}"

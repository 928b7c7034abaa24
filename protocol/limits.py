"""Hard limits on what a decoder accepts.

Every limit is checked before the object it bounds is built (the frame size before unpacking,
container lengths and nesting depth while scanning the msgpack headers), so a hostile frame costs
at most ``max_message_bytes`` of memory and a scan of ``max_objects`` headers.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds a decoder enforces. Both ends should use the same values; a server announces its
    ``max_message_bytes`` in the hello result."""

    max_message_bytes: int = 16 * MiB  # one frame, whole
    max_depth: int = 8  # nested maps/arrays; the deepest legal message (register_buffers) is 4
    max_objects: int = 65_536  # msgpack objects in one frame (keys, values, container headers)
    max_array_len: int = 4_096  # items in one msgpack array
    max_map_len: int = 256  # pairs in one msgpack map
    max_str_len: int = 4_096  # bytes in one string
    max_bin_len: int = 16 * MiB  # bytes in one binary (id arrays, inline payloads)
    max_ids: int = 1 << 20  # token or page ids in one id array (4 MiB as int32)
    max_inline_bytes: int = 4 * MiB  # inline page payload of put_pages/get_pages

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()

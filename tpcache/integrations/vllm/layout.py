"""The layout adapter: vLLM's per-layer KV tensors seen as rows of whole blocks.

vLLM hands the connector one tensor per attention layer; dimension 0 (or 1, behind a leading K/V
dimension of 2) counts blocks, and the physical order of the other dimensions depends on the
attention backend (on CPU: ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, K and V side by
side). For each layer, the dimensions stored outside the block dimension are enumerated into
parts; the ones inside must be dense, so that one block of one part is one contiguous row. A host
page is a block's rows over every layer and part, in the engine's own byte order; the format name
(shapes without the block count, and the physical order) is part of every storage key, so a
restart with another KV layout never reads these pages.

Under vLLM's hybrid allocator each KV cache group (full attention, sliding window) has a block
table of its own: a page is one block of every group, each layer read at its group's block
(``EngineKV`` groups, one int per page). A sliding-window group names vLLM's null block for a page
it freed behind its window: a save stops before such a page, a load skips its rows.

A Mamba (recurrent-state) group keeps one state block per request, which holds the state after
the tokens computed so far: it is a page's state only in the step whose tokens end at that page's
boundary. A page carries its group's state block and a flag row (``STATE_FLAG`` bytes, a tensor of
the connector's own, 1 for every block but the null block's 0): a page saved where no state of its
boundary exists names block 0 and is stored flagged "no state"; a hit ends at a page whose flag
says it carries one (``EngineKV.state_flags``). With a state group every layer is copied as bytes,
each in its own format.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import torch

from tpcache.core.external import NOT_HELD
from tpcache.io.engine_kv import EngineKV
from tpcache.io.errors import KVLayoutError
from tpcache.io.kv_pool import KVLayout

NULL_BLOCK = 0  # vLLM's null block (``BlockPool.null_block``, the first block of its pool)
STATE_FLAG = "tpcache.state_flag"  # the flag part's name in a format description


def _block_dim(t: torch.Tensor, num_blocks: int) -> int:
    if t.dim() >= 2 and t.shape[0] == num_blocks:
        return 0
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return 1
    raise KVLayoutError(f"no block dimension ({num_blocks} blocks) in a KV tensor of shape {tuple(t.shape)}")


def layer_parts(t: torch.Tensor, num_blocks: int) -> tuple[list[torch.Tensor], str]:
    """One layer's ``[num_blocks, row]`` views and a description of its format."""
    bdim = _block_dim(t, num_blocks)
    dims = [d for d in range(t.dim()) if d != bdim and t.shape[d] > 1]
    order = sorted(dims, key=lambda d: -t.stride(d))  # physical order, outermost first
    outer = [d for d in order if t.stride(d) > t.stride(bdim)]
    inner = [d for d in order if t.stride(d) <= t.stride(bdim)]
    row = 1
    for d in reversed(inner):
        if t.stride(d) != row:
            raise KVLayoutError(f"KV tensor {tuple(t.shape)} strides {t.stride()}: a block's data is not dense")
        row *= t.shape[d]
    if t.stride(bdim) < row:
        raise KVLayoutError(f"KV tensor {tuple(t.shape)} strides {t.stride()}: blocks overlap")
    parts = []
    for index in itertools.product(*(range(t.shape[d]) for d in outer)):
        offset = t.storage_offset() + sum(i * t.stride(d) for i, d in zip(index, outer, strict=True))
        parts.append(t.as_strided((num_blocks, row), (t.stride(bdim), 1), offset))
    shape = ["B" if d == bdim else str(s) for d, s in enumerate(t.shape)]
    physical = [*outer, bdim, *inner]
    fmt = f"[{','.join(shape)}]order={''.join(map(str, physical))}"
    return parts, fmt


def engine_kv_from_vllm(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    group_of: Mapping[str, int] | None = None,
    sliding: Sequence[bool] = (),
    states: Sequence[bool] = (),
) -> tuple[EngineKV, KVLayout, str]:
    """The adapter over vLLM's ``kv_caches`` (layer name -> tensor, in model order), the host page
    layout it needs, and the engine format name. ``group_of``: each layer's KV cache group (vLLM's
    hybrid allocator gives each group its own block table); ``sliding``: per group, whether it frees
    the blocks behind its window (its null block then stands for a page it no longer holds);
    ``states``: per group, whether it is a recurrent-state (Mamba) group."""
    if not kv_caches:
        raise KVLayoutError("vLLM registered no KV cache tensors")
    if any(states):
        return _engine_kv_with_states(kv_caches, num_blocks, block_size, group_of or {}, sliding, states)
    parts: list[torch.Tensor] = []
    groups: list[int] = []
    layers: list[int] = []  # each part's layer, in kv_caches order (the connector's layer index)
    formats: list[str] = []
    per_layer = None
    for name, tensor in kv_caches.items():
        if group_of is not None and name not in group_of:
            raise KVLayoutError(f"layer {name} is in no KV cache group")
        layer, fmt = layer_parts(tensor, num_blocks)
        groups += [group_of[name] if group_of is not None else 0] * len(layer)
        layers += [len(formats)] * len(layer)
        elems = sum(int(p.shape[1]) for p in layer)
        if per_layer is not None and elems != per_layer:
            raise KVLayoutError(f"layer {name} holds {elems} elements per block, others {per_layer}")
        per_layer = elems
        parts.extend(layer)
        formats.append(fmt)
    assert per_layer is not None
    if len(set(formats)) != 1:
        raise KVLayoutError(f"KV layers differ in format: {sorted(set(formats))}")
    if per_layer % (2 * block_size):
        raise KVLayoutError(f"a block of {per_layer} elements does not split into K and V of {block_size} tokens")
    dtype = parts[0].dtype
    # The host page holds the same number of elements as one block over every layer.
    layout = KVLayout(len(kv_caches), 1, per_layer // (2 * block_size), dtype, block_size)
    nullable = [g for g, s in enumerate(sliding) if s]
    return EngineKV(parts, groups, nullable, layers), layout, f"vllm{formats[0]}{dtype}"


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t
    if t.dim() == 0 or t.stride(-1) != 1:
        raise KVLayoutError(
            f"a KV tensor of shape {tuple(t.shape)} strides {t.stride()}: its last dimension is not dense"
        )
    return t.view(torch.uint8)


def _engine_kv_with_states(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    group_of: Mapping[str, int],
    sliding: Sequence[bool],
    states: Sequence[bool],
) -> tuple[EngineKV, KVLayout, str]:
    """``engine_kv_from_vllm`` for a model with a Mamba group: every layer's block as bytes (a state
    block and an attention block differ in size and format), and a flag part in the first state
    group, sized so that the page splits into the host layout's K and V of ``block_size`` tokens."""
    parts: list[torch.Tensor] = []
    groups: list[int] = []
    layers: list[int] = []
    formats: list[str] = []
    for index, (name, tensor) in enumerate(kv_caches.items()):
        if name not in group_of:
            raise KVLayoutError(f"layer {name} is in no KV cache group")
        # a state layer may hand over one tensor per state (conv, SSM): all of them are its layer's
        tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
        for t in tensors:
            layer, fmt = layer_parts(_as_bytes(t), num_blocks)
            groups += [group_of[name]] * len(layer)
            layers += [index] * len(layer)
            parts.extend(layer)
            formats.append(f"{fmt}{t.dtype}")
    num_layers = len(kv_caches)
    unit = num_layers * 2 * block_size  # the host layout's bytes per unit of head_dim
    total = sum(int(p.shape[1]) for p in parts)
    head_dim = total // unit + 1
    flag_bytes = head_dim * unit - total
    flags = torch.ones(num_blocks, flag_bytes, dtype=torch.uint8, device=parts[0].device)
    flags[NULL_BLOCK] = 0
    state_group = next(g for g, s in enumerate(states) if s)
    parts.append(flags)
    groups.append(state_group)
    layers.append(layers[-1])  # copied with the last layer (no layer of its own for copies by layer)
    layout = KVLayout(num_layers, 1, head_dim, torch.uint8, block_size)
    nullable = [g for g, s in enumerate(sliding) if s]
    kv = EngineKV(parts, groups, nullable, layers, states=[g for g, s in enumerate(states) if s])
    kv.state_flag_part = len(parts) - 1
    described = ";".join(formats)
    return kv, layout, f"vllm[{described}];{STATE_FLAG}{flag_bytes}"


def page_ids(kv: EngineKV, blocks: Sequence[Sequence[int]], *, save: bool) -> list[int]:
    """One int per page (``EngineKV.page_id``) from vLLM's block ids per group. For a save, a page
    that a sliding-window group no longer holds (its null block) is ``NOT_HELD``: its window data is
    gone, so neither it nor any page after it is saved from this request."""
    out: list[int] = []
    for ids in zip(*blocks, strict=True):
        if save and any(ids[g] == NULL_BLOCK for g in kv.nullable):
            out.append(NOT_HELD)
        else:
            out.append(kv.page_id(ids))
    return out


def leading_unheld(kv: EngineKV, blocks: Sequence[Sequence[int]]) -> int:
    """Leading pages no group holds (a model whose every group is sliding-window: the pages of a
    hit before the window). A load skips them."""
    n = 0
    for ids in zip(*blocks, strict=True):
        if not all(g in kv.nullable and b == NULL_BLOCK for g, b in enumerate(ids)):
            break
        n += 1
    return n


def model_page_view(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> tuple[KVLayout, Callable[[torch.Tensor], torch.Tensor]]:
    """The host page of ``engine_kv_from_vllm`` seen as the model's KV: the canonical layout of this
    rank's slice (``[layers, 2, block_size, num_kv_heads, head_size]`` of ``dtype``) and a function
    from a page's bytes (flat ``uint8``) to a view of them in that order (``[layers, 2, tokens,
    heads, head bytes]``).

    vLLM's per-layer tensors are its logical ``[blocks, heads, tokens, content]``, the content a
    token's K then its V (``2 * head_size`` values, seen as any element type), in whatever physical
    order the attention backend keeps. Raises KVLayoutError for any other shape (a packed or
    quantized content, kernel blocks smaller than vLLM's, K and V of different sizes)."""
    t = next(iter(kv_caches.values()))
    head_bytes = head_size * dtype.itemsize
    content = t.shape[-1] * t.element_size() if t.dim() == 4 else 0
    if t.dim() != 4 or tuple(t.shape[:3]) != (num_blocks, num_kv_heads, block_size) or content != 2 * head_bytes:
        raise KVLayoutError(
            f"a KV tensor of shape {tuple(t.shape)} ({t.dtype}) is not vLLM's [blocks, KV heads, tokens, K and V] "
            f"of {num_blocks} x {num_kv_heads} x {block_size} x 2 x {head_size} {dtype} (a packed or quantized "
            "cache, or kernel blocks of another size)"
        )
    _, fmt = layer_parts(t, num_blocks)
    # The order a page holds one layer's dimensions in (``layer_parts``): outermost first, those
    # outside the block dimension before those inside; size-1 dimensions hold no order.
    dims = [d for d in (1, 2, 3) if t.shape[d] > 1]
    order = sorted(dims, key=lambda d: -t.stride(d))
    if dims and order[-1] != 3:
        raise KVLayoutError(f"KV tensors in the format {fmt}: a token's K and V are not innermost")
    sizes = {1: num_kv_heads, 2: block_size, 3: 2 * head_bytes}
    num_layers = len(kv_caches)

    def view(flat: torch.Tensor) -> torch.Tensor:
        page = flat.view(num_layers, *(sizes[d] for d in order))
        # back to the logical [layers, heads, tokens, content], the size-1 dimensions put back
        page = page.permute(0, *(1 + order.index(d) for d in dims))
        for d in (1, 2, 3):
            if d not in dims:
                page = page.unsqueeze(d)
        page = page.unflatten(3, (2, head_bytes))  # [layers, heads, tokens, K or V, head bytes]
        return page.permute(0, 3, 2, 1, 4)

    return KVLayout(num_layers, num_kv_heads, head_size, dtype, block_size), view

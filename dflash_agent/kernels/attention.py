"""Attention of new tokens over a KV cache whose visibility comes from positions, not a mask tensor.

Key j is visible to query i iff k_pos[j] >= 0, k_pos[j] <= q_pos[i] and k_pos[j] > q_pos[i] - window:
the causal block mask of decode / verification, the sliding window, and a ring buffer's slot -> position
map (-1 = empty) in one rule, which is what engine.model.gemma's masks say. Grouped-query attention: query
head h reads KV head h // (heads / kv_heads). Softmax in float32, scores `scale * q.k`.

- `cache_attention_reference`: plain PyTorch (SDPA with K/V repeated per query head, which keeps
  head_dim 512 on SDPA's memory-efficient kernel; with enable_gqa it falls back to the O(S^2) math one).
- `cache_attention`: flash-attn where it applies (installed with the `gpu` extra; head_dim <= 256, the
  cache in position order ending at the last query), else the Triton kernel (kernels.triton.attention_triton,
  imported only where it runs), else the reference.
- `rows_cache_attention` / `write_rows`: several sequences' decode rows, each over its own cache, in one launch
  (Triton only): the caches are read at element offsets from the first one's (`cache_offsets`).

int8 caches (engine.cache.kv_cache's q8 layout: a scale per run of head_dim / blocks values of a slot's head)
are read and scaled by the kernel as they are read, so the cache is never expanded in memory.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .dispatch import triton_runs

NO_WINDOW = 1 << 62  # "window" of full-attention layers: every earlier key is in reach
BLOCKED_ROWS = 128  # query rows from which the CPU attends block by block (_blocked_attention), and its block
# A sequence's cache as element offsets from another's: keys, values and their int8 scales (0 when not quantized).
OFFSETS_PER_CACHE = 4
# The kernels read a cache at its offsets as 16-element aligned (vector loads), which every whole cache tensor is
# (CUDA's allocator aligns blocks to 512 bytes, the CPU's to 64, and a cache element takes at most 4 bytes).
OFFSET_ALIGN = 16


@dataclass(frozen=True)
class KeysFromValues:
    """How a layer that keeps only V rebuilds its keys: K = rope(V * weight) at each key's position (NeoX pairs: dim
    i with i + d / 2), computed in float32. weight: k_norm's, its offset applied; inv_freq: the layer's RoPE
    inverse frequencies [d / 2] (zero where a pair does not rotate)."""

    weight: torch.Tensor  # [d] float32
    inv_freq: torch.Tensor  # [d / 2] float32

    def keys(self, values: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """values [S, heads, d] (in a float dtype) at positions [S] -> keys [S, heads, d] in `dtype`."""
        x = values.float() * self.weight
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = (torch.cat((f, f), dim=-1)[:, None, :] for f in (angles.cos(), angles.sin()))
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos + rotated * sin).to(dtype)


def visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[T, S] bool, True where key j is visible to query i."""
    q, k = q_pos[:, None], k_pos[None, :]
    return (k >= 0) & (k <= q) & (k > q - (window or NO_WINDOW))


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """SDPA of q [..., T, H, d] over keys / values [..., S, kv_heads, d] with a [T, S] bool mask (True =
    visible) -> [..., T, H, d]. The query heads that share a KV head are folded into the query length, so the
    cache is never copied per head (enable_gqa sends the CPU to SDPA's math path, which does) and the call is
    4-D, the shape the CPU's flash kernel takes: 10-30x faster for a decode step on the CPU. From BLOCKED_ROWS
    float32 query rows on the CPU (prefill chunks), _blocked_attention instead."""
    *lead, T, H, d = q.shape
    S, kv = keys.shape[-3], keys.shape[-2]
    group, batch = H // kv, math.prod(lead)
    if mask is not None and T >= BLOCKED_ROWS and q.device.type == "cpu" and q.dtype == torch.float32:
        return _blocked_attention(q, keys, values, mask, scale)
    folded = q.reshape(batch, T, kv, group, d).permute(0, 2, 3, 1, 4).reshape(batch, kv, group * T, d)
    out = F.scaled_dot_product_attention(
        folded, keys.reshape(batch, S, kv, d).transpose(1, 2), values.reshape(batch, S, kv, d).transpose(1, 2),
        attn_mask=None if mask is None else mask.repeat(group, 1), scale=scale,
    )
    return out.view(batch, kv, group, T, d).permute(0, 3, 1, 2, 4).reshape(*lead, T, H, d)


def _blocked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """grouped_attention for many query rows on the CPU: blocks of BLOCKED_ROWS rows, each two GEMMs and a softmax
    over only the keys its rows see (the causal triangle and the sliding window skip the rest, which SDPA's CPU
    kernels compute under the mask): 2-3x faster on a 512-token prefill chunk, 3.5x over a 4K-key window. The
    scale goes into the queries and the mask is added as a bias over each block's [group, rows] queries of a KV
    head, so the scores take one pass before the softmax."""
    *lead, T, H, d = q.shape
    S, kv = keys.shape[-3], keys.shape[-2]
    group, batch = H // kv, math.prod(lead)
    queries = (q * scale).reshape(batch, T, kv, group, d).permute(0, 2, 3, 1, 4)  # [batch, kv, group, T, d]
    k = keys.reshape(batch, S, kv, d).transpose(1, 2)[:, :, None]  # [batch, kv, 1, S, d]
    v = values.reshape(batch, S, kv, d).transpose(1, 2)[:, :, None]
    out = torch.empty(batch, kv, group, T, d, dtype=q.dtype)
    for start in range(0, T, BLOCKED_ROWS):
        end = min(start + BLOCKED_ROWS, T)
        visible = mask[start:end]
        cols = visible.any(0).nonzero()
        if cols.numel() == 0:  # rows with no key in reach get zeros, as from SDPA
            out[:, :, :, start:end] = 0
            continue
        lo, hi = int(cols[0]), int(cols[-1]) + 1
        scores = torch.matmul(queries[:, :, :, start:end], k[:, :, :, lo:hi].transpose(-1, -2))
        scores += torch.zeros(end - start, hi - lo, dtype=q.dtype).masked_fill_(~visible[:, lo:hi], float("-inf"))
        out[:, :, :, start:end] = torch.matmul(torch.softmax(scores, dim=-1), v[:, :, :, lo:hi])
        blind = ~visible.any(1)
        if blind.any():
            out[:, :, :, start:end][:, :, :, blind] = 0
    return out.permute(0, 3, 1, 2, 4).reshape(*lead, T, H, d)


def _expand(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return cache.to(dtype)
    scale = blocked_scales(scale)
    return cache.to(dtype) * scale.repeat_interleave(cache.shape[-1] // scale.shape[-1], dim=-1).to(dtype)


def blocked_scales(scale: torch.Tensor) -> torch.Tensor:
    # int8 caches carry [slots, kv_heads, blocks] scales (one per head_dim / blocks values); [slots, kv_heads]
    # is one block per head
    return scale[..., None] if scale.dim() == 2 else scale


def cache_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor | None,
    window: int | None,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    keys_from: KeysFromValues | None = None,
) -> torch.Tensor:
    """q [T, H, d], k / v [S, kv_heads, d] (int8 with k_scale / v_scale [S, kv_heads, blocks] scaling runs of
    d / blocks values, or [S, kv_heads]: one block), q_pos [T],
    k_pos [S] or None (slot index = position) -> [T, H, d] in q's dtype. keys_from: the cache keeps V alone (k is
    v), and the keys are rebuilt from it at their positions."""
    S, kv_heads = k.shape[0], k.shape[1]
    if k_pos is None:
        k_pos = torch.arange(S, device=k.device)
    group = q.shape[1] // kv_heads
    values = _expand(v, v_scale, q.dtype)
    keys = _expand(k, k_scale, q.dtype) if keys_from is None else keys_from.keys(values, k_pos.clamp_min(0), q.dtype)
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=visibility(q_pos, k_pos, window), scale=scale,
    )
    return out.transpose(0, 1)


def flash_attn_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether cache_attention sends an unquantized cache in position order (`contiguous`) to flash-attn."""
    return (device.type == "cuda" and head_dim <= 256 and dtype in (torch.float16, torch.bfloat16)
            and importlib.util.find_spec("flash_attn") is not None)


def triton_takes(head_dim: int) -> bool:
    """Whether the Triton kernel takes a head size (its tiles span head_dim, a power of two)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def cache_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor | None,
    window: int | None,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    contiguous: bool = False,
    keys_from: KeysFromValues | None = None,
) -> torch.Tensor:
    """As `cache_attention_reference`, on the fastest path that applies.

    contiguous: the caller guarantees slot j holds position j for every slot and the queries are the
    last T positions (a full-attention cache sliced to the sequence end), so flash-attn's own causal
    mask is the position rule. Without it, slots past the queries are skipped by position alone, so a
    whole preallocated cache can be passed (what CUDA graphs need: shapes that do not grow).
    k_pos is a sliding ring's map, a window's slots whatever the context: the Triton kernel splits its keys in
    shorter chunks than a full cache's (kernels.dispatch.RING_KEYS_PER_CHUNK), whose partials the memory plan sizes.
    """
    if (contiguous and k_pos is None and k_scale is None and keys_from is None
            and flash_attn_takes(q.device, q.dtype, q.shape[-1])):
        from flash_attn import flash_attn_func

        out = flash_attn_func(q[None], k[None], v[None], softmax_scale=scale, causal=True,
                              window_size=(window - 1, 0) if window else (-1, -1))
        return out[0]
    if triton_runs(q) and triton_takes(q.shape[-1]):
        from .triton.attention_triton import triton_cache_attention

        return triton_cache_attention(q, k, v, q_pos, k_pos, window, scale, k_scale, v_scale, keys_from)
    return cache_attention_reference(q, k, v, q_pos, k_pos, window, scale, k_scale, v_scale, keys_from)


def rows_cache_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor | None,
    window: int | None,
    scale: float,
    offsets: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    keys_from: KeysFromValues | None = None,
) -> torch.Tensor:
    """Row t of q [T, H, d] (one new token of its own sequence, at q_pos[t]) over its own cache: k / v (and scales)
    are the first row's, the others' lie offsets[t] elements further (cache_offsets, as a [T, OFFSETS_PER_CACHE]
    tensor); k_pos [T, slots] each row's slot -> position map, None where slot = position. Each row comes out as
    `cache_attention` of it alone over its cache gives it on the Triton kernel. Triton only."""
    from .triton.attention_triton import rows_attention_launch

    q = q.contiguous() if q.stride(-1) != 1 else q
    return rows_attention_launch(q, k, v, q_pos, k_pos, window, scale, offsets, k_scale, v_scale, keys_from).run()


def write_rows(k_new: torch.Tensor, v_new: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               offsets: torch.Tensor) -> None:
    """Row t's new key and value [T, kv_heads, d] into slot slots[t] of its own cache (k / v the first row's, as
    rows_cache_attention's), in one launch: the values as given (an int8 cache's quantized ones, or its scales with
    the offsets' scale columns: engine.cache.kv_cache.LayerKV.write_rows). Triton only."""
    from .triton.attention_triton import write_rows_launch

    write_rows_launch(k_new.contiguous(), v_new.contiguous(), k, v, slots, offsets)()


def cache_offsets(caches: list[list[torch.Tensor]]) -> list[list[int]] | None:
    """Each sequence's cache tensors (keys, values and, quantized, their scales) as element offsets from the first
    sequence's: rows_cache_attention's and write_rows' `offsets`. None where they cannot share a launch (another
    dtype, shape, strides or device, or an offset the kernels' aligned loads would miss)."""
    first = caches[0]
    out = []
    for tensors in caches:
        if len(tensors) != len(first):
            return None
        row = []
        for t, base in zip(tensors, first, strict=True):
            if (t.dtype, t.shape, t.stride(), t.device) != (base.dtype, base.shape, base.stride(), base.device):
                return None
            gap, rest = divmod(t.data_ptr() - base.data_ptr(), t.element_size())
            if rest or gap % OFFSET_ALIGN:
                return None
            row.append(gap)
        out.append(row + [0] * (OFFSETS_PER_CACHE - len(row)))
    return out

"""KV cache for one sequence: full-attention layers grow, sliding-window layers keep a ring.

Keys and values are kept in the model's dtype, or in 8 bits ("q8": int8 with one scale per 32 values
of a token's head, llama.cpp's q8_0 layout), which nearly halves a bf16 cache so longer contexts fit
beside a large model.

A full-attention layer of a config with attention_k_eq_v takes its keys and values from one projection:
V = rms(k_raw) and K = rope(V * k_norm.weight). Such a layer can keep V alone (`KeysFromValues`) and have K
rebuilt where attention reads it, which halves what the context costs it.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ...kernels.attention import KeysFromValues, cache_offsets, write_rows
from ..errors import OptionError
from ..formats.config import LayerSpec, ModelConfig
from ..limits import DEFAULT_SLACK
from ..types import STORED_KV_DTYPES

Q8_BLOCK = 32  # values per scale, as llama.cpp's q8_0: one scale per head row flattens rows with outliers


def quantize_q8(x: torch.Tensor, block: int = Q8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, heads, d] -> (int8 [T, heads, d], scales [T, heads, d / block] in x's dtype): symmetric
    absmax over each run of `block` values."""
    T, heads, d = x.shape
    xb = x.float().reshape(T, heads, d // block, block)
    scale = xb.abs().amax(-1).clamp_min(1e-12) / 127.0
    q = torch.round(xb / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(T, heads, d), scale.to(x.dtype)


def dequantize_q8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    T, heads, d = q.shape
    blocks = scale.shape[-1]
    return (q.view(T, heads, blocks, d // blocks).to(scale.dtype) * scale[..., None]).view(T, heads, d)


@dataclass
class LayerKV:
    # [slots, num_kv_heads, head_dim]; full layers: slot == position; int8 when quantized. train.target batches
    # unquantized caches as [rows, slots, num_kv_heads, head_dim].
    k: torch.Tensor
    v: torch.Tensor
    sliding: bool
    k_scale: torch.Tensor | None = None  # [slots, num_kv_heads, head_dim / block] in the model dtype, or None
    v_scale: torch.Tensor | None = None
    # set where the layer keeps V alone (in the model's dtype): k is v, and attention rebuilds the keys from it
    keys_from: KeysFromValues | None = None

    def kernel_tensors(self) -> list[torch.Tensor]:
        """Keys, values and (quantized) their scales as the attention kernels take them (one tensor twice where the
        layer keeps V alone)."""
        if self.k_scale is None or self.v_scale is None:
            return [self.k, self.v]
        return [self.k, self.v, self.k_scale, self.v_scale]

    def storage(self) -> list[torch.Tensor]:
        """Every tensor that holds this layer's state, slot-major (what a snapshot copies), each once."""
        tensors = self.kernel_tensors()
        return tensors if self.keys_from is None else tensors[1::2]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.keys_from is not None:  # the keys are V's: writing V writes both
            k = v
        if self.k_scale is None or self.v_scale is None:
            # slot-major after any leading batch dimension (train.target's batched caches)
            self.k[..., slots, :, :] = k
            self.v[..., slots, :, :] = v
            return
        block = self.k.shape[-1] // self.k_scale.shape[-1]
        self.k[slots], self.k_scale[slots] = quantize_q8(k, block)
        self.v[slots], self.v_scale[slots] = quantize_q8(v, block)

    def write_rows(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> None:
        """Row t of k / v [T, kv_heads, d] into slot slots[t] of row t's cache, this layer being the first row's and
        the others lying `offsets` [T, 4] from it (kernels.attention.cache_offsets), in one launch per tensor pair:
        each row quantizes alone, as write gives it."""
        if self.keys_from is not None:
            k = v
        if self.k_scale is None or self.v_scale is None:
            write_rows(k, v, self.k, self.v, slots, offsets)
            return
        block = self.k.shape[-1] // self.k_scale.shape[-1]
        (qk, k_scale), (qv, v_scale) = quantize_q8(k, block), quantize_q8(v, block)
        write_rows(qk, qv, self.k, self.v, slots, offsets)
        write_rows(k_scale, v_scale, self.k_scale, self.v_scale, slots, offsets[:, 2:])

    def read(self, end: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [:end] (all slots when end is None), in the model's dtype."""
        k, v = (self.k, self.v) if end is None else (self.k[..., :end, :, :], self.v[..., :end, :, :])
        if self.k_scale is not None and self.v_scale is not None:
            ks, vs = (self.k_scale, self.v_scale) if end is None else (self.k_scale[:end], self.v_scale[:end])
            k, v = dequantize_q8(k, ks), dequantize_q8(v, vs)
        if self.keys_from is not None:  # a full layer's: slot = position
            k = self.keys_from.keys(v, torch.arange(v.shape[-3], device=v.device), v.dtype)
        return k, v


# The one stored KV dtype whose layers may keep V alone: the Triton kernel that rebuilt keys from int8 values ran out
# of registers at head size 512.
VALUES_ONLY_KV = "model"


def keeps_values_only(spec: LayerSpec, kv_dtype: str = VALUES_ONLY_KV) -> bool:
    """Whether a layer of a cache storing `kv_dtype` may keep V alone: a full-attention layer that owns its K / V and
    takes both from one projection (attention_k_eq_v), in the model's dtype."""
    return spec.k_eq_v and not spec.sliding and spec.kv_source is None and kv_dtype == VALUES_ONLY_KV


@dataclass
class RingSnapshot:
    """Copies of every sliding layer's ring and the shared position map, taken at one cache length."""

    ring_pos: torch.Tensor
    rings: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.ring_pos.nbytes + sum(t.nbytes for t in self.rings)


class Snapshots(ABC):
    """Copies and restores of a cache's state for the prefix cache (the target's KVCache, the drafter's
    DrafterCache), on what the cache says it holds."""

    length: int
    ring_pos: torch.Tensor

    @abstractmethod
    def full_state(self) -> list[torch.Tensor]:
        """The tensors whose slot is the position (all positions), themselves."""

    @abstractmethod
    def ring_state(self) -> RingSnapshot:
        """The rings and their position map, themselves."""

    @abstractmethod
    def rings_hold(self, length: int) -> bool:
        """Whether the rings still hold the window before `length`."""

    def full_snapshot(self, length: int, device: torch.device | str) -> list[torch.Tensor]:
        """Copies of the full layers' state for positions [:length]."""
        return [t[:length].to(device, copy=True) for t in self.full_state()]

    def ring_snapshot(self, device: torch.device | str) -> RingSnapshot:
        state = self.ring_state()
        return RingSnapshot(state.ring_pos.to(device, copy=True), [t.to(device, copy=True) for t in state.rings])

    def restore(self, length: int, full: list[torch.Tensor] | None, ring: RingSnapshot | None) -> None:
        """Set the cache to `length` tokens: full layers from `full` (None: keep what they hold, which must
        cover [:length]), rings from `ring` (None: roll back within the rings' reach)."""
        if full is None and length > self.length:
            raise ValueError(f"cannot extend a cache of {self.length} tokens to {length} without their keys")
        if full is not None:
            for dst, src in zip(self.full_state(), full, strict=True):
                dst[:length].copy_(src[:length])
        if ring is not None:
            for dst, src in zip(self.ring_state().rings, ring.rings, strict=True):
                dst.copy_(src)
            self.ring_pos.copy_(ring.ring_pos)
        elif not self.rings_hold(length):
            raise ValueError(f"the sliding rings no longer hold the window before position {length}")
        self.length = length


class KVCache(Snapshots):
    """Keys and values of the tokens committed so far, for a single sequence.

    A sliding ring holds `window + slack` slots, so after a forward of up to `slack + 1` tokens the cache can be
    rolled back to any position inside that forward and still hold the window every later query needs.
    Going back further needs the ring as it was then: `ring_snapshot` / `restore`.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        slack: int = DEFAULT_SLACK,
        kv_dtype: str = "model",
        keys_from: dict[int, KeysFromValues] | None = None,
    ) -> None:
        """keys_from: the layers that keep V alone (full-attention layers of a config with attention_k_eq_v,
        `keeps_values_only`), with how each rebuilds its keys; in the model's dtype only (VALUES_ONLY_KV)."""
        if kv_dtype not in STORED_KV_DTYPES:  # "auto" is the memory plan's to resolve
            raise OptionError(f"a KV cache stores {' or '.join(STORED_KV_DTYPES)}, not {kv_dtype!r}")
        self.max_len = max_len
        self.slack = slack
        self.window = config.sliding_window
        self.kv_dtype = kv_dtype
        self.length = 0
        self.ring_slots = min(max_len, config.sliding_window + slack)
        # Every sliding layer writes the same positions to the same slots, so they share one position map.
        self.ring_pos = torch.full((self.ring_slots,), -1, device=device, dtype=torch.long)
        # one per layer; a layer that shares another's K / V (spec.kv_source) holds that layer's LayerKV
        self.layers: list[LayerKV] = []
        quantized = kv_dtype == "q8"
        if keys_from and kv_dtype != VALUES_ONLY_KV:
            raise ValueError("an 8-bit cache keeps its keys: only one in the model's dtype keeps V alone")
        for spec in config.layers:
            if spec.kv_source is not None:
                self.layers.append(self.layers[spec.kv_source])
                continue
            shape = (self.ring_slots if spec.sliding else max_len, spec.num_kv_heads, spec.head_dim)
            store = torch.int8 if quantized else dtype
            rebuild = (keys_from or {}).get(len(self.layers))
            if rebuild is not None and not keeps_values_only(spec, kv_dtype):
                raise ValueError(f"layer {len(self.layers)} keeps its own keys: it cannot rebuild them from V")
            v = torch.zeros(shape, device=device, dtype=store)
            k = v if rebuild is not None else torch.zeros(shape, device=device, dtype=store)
            scales: list[torch.Tensor | None] = [None, None]
            if quantized:
                block = min(Q8_BLOCK, spec.head_dim)
                if spec.head_dim % block:
                    raise OptionError(f"q8 KV needs a head size that is a multiple of {Q8_BLOCK}, not {spec.head_dim}")
                scales = [torch.zeros((*shape[:2], spec.head_dim // block), device=device, dtype=dtype)
                          for _ in range(2)]
            self.layers.append(LayerKV(k, v, spec.sliding, *scales, keys_from=rebuild))
        # offsets_of's tables by the other caches' ids, with weak references that tell a reused id from its cache
        self._offsets: dict[tuple[int, ...], tuple[list[weakref.ref[KVCache]], torch.Tensor | None]] = {}

    @property
    def device(self) -> torch.device:
        return self.ring_pos.device

    def offsets_of(self, caches: list[KVCache]) -> torch.Tensor | None:
        """Where each of `caches`' tensors lie from this cache's, per layer ([layers, caches, OFFSETS_PER_CACHE] on
        the device, kernels.attention.cache_offsets'), or None where one of them is laid out otherwise. Found once per
        list of caches: a cache's tensors stay where they were made."""
        key = tuple(id(cache) for cache in caches)
        known = self._offsets.get(key)
        if known is not None and all(ref() is cache for ref, cache in zip(known[0], caches, strict=True)):
            return known[1]
        table = []
        for i, layer in enumerate(self.layers):
            offsets = cache_offsets([layer.kernel_tensors(), *(cache.layers[i].kernel_tensors() for cache in caches)])
            if offsets is None:
                table = None
                break
            table.append(offsets[1:])
        found = None if table is None else torch.tensor(table, dtype=torch.int64, device=self.device)
        # the tables of lists with a freed cache go: no id of theirs can come back as the same cache
        self._offsets = {k: v for k, v in self._offsets.items() if all(ref() is not None for ref in v[0])}
        self._offsets[key] = ([weakref.ref(cache) for cache in caches], found)
        return found

    @property
    def owned(self) -> list[LayerKV]:
        """Each layer's K / V once: the layers that share another's are left out (what memory and snapshots count)."""
        seen: set[int] = set()
        return [layer for layer in self.layers if not (id(layer) in seen or seen.add(id(layer)))]

    @property
    def has_rings(self) -> bool:
        return any(layer.sliding for layer in self.layers)

    def rollback(self, length: int) -> None:
        """Forget every token at position >= length (rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0
        self.ring_pos.fill_(-1)

    def rings_hold(self, length: int) -> bool:
        """Whether the rings still hold the window before `length`, so `rollback(length)` is exact."""
        if not self.has_rings or length == 0:
            return True
        wanted = torch.arange(max(0, length - self.window), length, device=self.device)
        return bool((self.ring_pos[wanted % self.ring_slots] == wanted).all())

    # --- snapshots (the prefix cache) -------------------------------------------------------------

    def full_state(self) -> list[torch.Tensor]:
        """The full-attention layers' tensors themselves (all positions): what `restore` writes, or reads from
        another cache of the same model."""
        return [t for layer in self.owned if not layer.sliding for t in layer.storage()]

    def ring_state(self) -> RingSnapshot:
        """The rings and their position map themselves, not copies: another cache of the same model restored from
        them at a length they hold (`rings_hold`) gets what this one holds there."""
        return RingSnapshot(self.ring_pos, [t for layer in self.owned if layer.sliding for t in layer.storage()])


"""Prefix reuse across requests: a request prefills only what its cached prefix does not cover.

The engine has a working KV cache (and drafter cache) per slot on its device. After a request a slot's caches hold
that request's conversation, the "live" one: the prompt and the generated tokens whose keys were computed.
A new request reuses the longest common prefix it has with the live conversation or with a stored one.
Full-attention layers and the drafter's context K/V keep every position, so they are cut to the prefix
(the drafter's K/V is kept with the target's, so drafting after a hit sees the same context as without
the cache). Sliding-window rings have overwritten all but the last `window + slack` positions, so they
are rolled back within that reach, or else restored from a ring checkpoint.

Checkpoints rather than re-prefilling the last window: a sliding layer's keys at a position depend on the
hidden state there, which depends on every lower sliding layer's keys up to a window further back, so
re-running only the last window before the prefix does not reproduce the ring (the exact receptive field is
`layers x window` tokens). A checkpoint is one copy of the rings (window + slack slots per sliding layer) in
host RAM, taken where later requests tend to branch: at every prompt end, with the last token's logits so
a repeated prompt needs no forward at all, and every `checkpoint_every` tokens of a long prefill so another
conversation sharing a long system prompt finds one near its branch point.

Several conversations: when a request would discard a large part of the live conversation (another client,
a sub-agent, a branch), the live state is first copied out to a store: its full-layer and drafter K/V up to
its length plus a ring checkpoint there. Restoring copies a stored state back into the working caches. Stored
conversations sit on the device while `device_bytes` allows, then in host RAM up to `host_bytes`, and the
least recently used ones are dropped first. A cut that loses only a small tail (the chat template
re-rendering the last assistant turn) keeps nothing: that tail will not be asked for again.

Reuse is decided by comparing token ids only, so a hit can never hand one conversation another's KV.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .drafter_cache import DrafterCache
from .kv_cache import KVCache, RingSnapshot

log = logging.getLogger(__name__)


def default_host_bytes() -> int:
    """A quarter of the machine's RAM, at most 8 GiB (llama.cpp's --cache-ram default)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2 << 30
    return min(8 << 30, total // 4)


@dataclass(frozen=True)
class PrefixCacheConfig:
    host_bytes: int = field(default_factory=default_host_bytes)  # stored conversations and checkpoints
    device_bytes: int = 0  # stored conversations kept on the model's device besides the working cache
    max_entries: int = 16  # stored conversations (the one in the working cache is not counted)
    checkpoint_every: int = 4096  # a ring checkpoint every this many prefilled tokens, besides prompt ends
    max_checkpoints: int = 8  # per conversation
    min_tokens: int = 64  # shorter conversations, or tails, are not worth a copy


@dataclass
class PrefixCacheStats:
    requests: int = 0  # requests that used the cache (cache_prompt on)
    hits: int = 0  # of those, requests that reused at least one token
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the cache
    stored: int = 0  # conversations copied out of the working cache
    restored: int = 0  # hits served from a stored conversation
    lent: int = 0  # hits served from another slot's request in flight (its prompt's chunks done)
    evicted: int = 0
    entries: int = 0  # stored conversations now
    host_bytes: int = 0  # now
    device_bytes: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Reuse:
    tokens: int = 0  # prompt tokens the working caches already hold
    logits: torch.Tensor | None = None  # [vocab] of the last prompt token when the whole prompt was cached


# eq=False: checkpoints and stored conversations are told apart by identity (list.remove, `in`); field equality
# would compare their tensors, which have no truth value
@dataclass(eq=False)
class RingCheckpoint:
    """A copy of the sliding-window rings at a position (and the last token's logits, at a prompt end): restores a
    prefix that ends there where the working rings cannot roll back that far."""

    position: int
    ring: RingSnapshot
    logits: torch.Tensor | None = None  # at prompt ends
    drafter_ring: RingSnapshot | None = None  # the drafter's rings there, where it has a cache

    @property
    def nbytes(self) -> int:
        return (self.ring.nbytes + (self.logits.nbytes if self.logits is not None else 0)
                + (self.drafter_ring.nbytes if self.drafter_ring is not None else 0))


@dataclass(eq=False)
class PrefixKV:
    """A prefix of tokens (a conversation so far) and the K/V state that holds their keys: stored, in a slot's
    working caches (its `live` one between requests) or lent from another slot's."""

    ids: list[int]  # the tokens whose keys this state holds
    checkpoints: list[RingCheckpoint]  # ascending positions, all <= len(ids)
    full: list[torch.Tensor] | None = None  # full-layer state [:len(ids)]; None while in the working cache
    drafter: list[torch.Tensor] | None = None  # the drafter's full layers' [:len(ids)]
    on_device: bool = False
    last_used: int = 0
    # Another slot's working caches, lent while its request runs (PrefixCache.lend): `full`, `drafter` and these
    # rings are its tensors themselves, valid until that request's next step; never stored
    lender: KVCache | None = None
    drafter_lender: DrafterCache | None = None

    @property
    def state_bytes(self) -> int:
        return sum(t.nbytes for t in (*(self.full or ()), *(self.drafter or ())))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    step = 256  # slices compare in C; only the block holding the first difference is walked in Python
    for i in range(0, n, step):
        j = min(i + step, n)
        if a[i:j] != b[i:j]:
            while a[i] == b[i]:
                i += 1
            return i
    return n


class PrefixStore:
    """The stored conversations and the budgets they share, for the working caches of every slot (one
    PrefixCache each): a conversation stored from one slot resumes in any other."""

    def __init__(self, config: PrefixCacheConfig) -> None:
        self.config = config
        self.stats = PrefixCacheStats()
        self.entries: list[PrefixKV] = []
        self.slots: list[PrefixCache] = []
        self.clock = itertools.count(1)
        self.host = torch.device("cpu")

    def thin(self, checkpoints: list[RingCheckpoint]) -> None:
        """Keep at most max_checkpoints: the newest always, then drop those closest to the one before, so
        the rest stay spread over the context."""
        while len(checkpoints) > max(1, self.config.max_checkpoints):
            gaps = [c.position - (checkpoints[i - 1].position if i else 0) for i, c in enumerate(checkpoints[:-1])]
            del checkpoints[gaps.index(min(gaps))]

    def usage(self) -> tuple[int, int]:
        """(host bytes, device bytes) held; a checkpoint shared by two conversations counts once."""
        seen: set[int] = set()
        host = device = 0
        lists = [e.checkpoints for e in self.entries] + [slot.own_checkpoints() for slot in self.slots]
        for checkpoints in lists:
            for c in checkpoints:
                if id(c) not in seen:
                    seen.add(id(c))
                    host += c.nbytes
        for entry in self.entries:
            if entry.on_device:
                device += entry.state_bytes
            else:
                host += entry.state_bytes
        return host, device

    def fit(self) -> None:
        """Move stored states off the device, then drop the least recently used, until the budgets hold."""
        by_age = sorted(self.entries, key=lambda e: e.last_used)
        host, device = self.usage()
        for entry in by_age:
            if device <= self.config.device_bytes:
                break
            if entry.on_device:
                entry.full = [t.to(self.host) for t in entry.full or ()]
                entry.drafter = [t.to(self.host) for t in entry.drafter] if entry.drafter is not None else None
                entry.on_device = False
                host, device = self.usage()
        for entry in by_age:
            if host <= self.config.host_bytes and device <= self.config.device_bytes \
                    and len(self.entries) <= self.config.max_entries:
                break
            self.entries.remove(entry)
            self.stats.evicted += 1
            host, device = self.usage()
            log.debug("prefix cache: evicted a conversation of %d tokens", len(entry.ids))
        # What is left over budget belongs to the conversations in the working caches: drop their checkpoints.
        for slot in self.slots:
            own = slot.own_checkpoints()
            while host > self.config.host_bytes and own:
                del own[0]
                host, device = self.usage()
        self.stats.entries = len(self.entries)
        self.stats.host_bytes, self.stats.device_bytes = host, device


class PrefixCache:
    """Owns the contents of one slot's working caches between requests. Per request:
    `acquire(prompt)` -> prefill from `Reuse.tokens`, calling `prefilled` after each chunk -> decode ->
    `release(ids)` with the ids the working caches hold at the end. Slots that share a `store` share its
    stored conversations and budgets."""

    def __init__(self, config: PrefixCacheConfig, cache: KVCache, drafter_cache: DrafterCache | None,
                 store: PrefixStore | None = None) -> None:
        self.store = store or PrefixStore(config)
        self.store.slots.append(self)
        self.config = self.store.config
        self.cache = cache
        self.drafter_cache = drafter_cache
        self.stats = self.store.stats
        self._live: PrefixKV | None = None
        self._pending: list[RingCheckpoint] = []  # the request in flight's checkpoints
        self._caching = False  # whether the request in flight stores its state
        self._last_checkpoint = 0  # of the request in flight
        self._host = self.store.host

    def own_checkpoints(self) -> list[RingCheckpoint]:
        """The checkpoints of the conversation in this slot's working caches (the list itself)."""
        return self._pending if self._caching else (self._live.checkpoints if self._live is not None else [])

    def lend(self, ids: list[int]) -> PrefixKV:
        """This slot's working caches as a source another slot may restore from while this slot's request runs:
        `ids` the tokens they hold for sure (its prompt's chunks done). Read in place, between steps: the full
        layers up to len(ids), the rings at any position they still hold, and the checkpoints taken so far."""
        drafter = self.drafter_cache.full_state() if self.drafter_cache is not None else None
        return PrefixKV(list(ids), [c for c in self.own_checkpoints() if c.position <= len(ids)],
                        self.cache.full_state(), drafter, lender=self.cache, drafter_lender=self.drafter_cache)

    def reusable(self, prompt: list[int], lent: Sequence[PrefixKV] = ()) -> int:
        """How many of prompt's tokens `acquire` would reuse now."""
        return self._best(prompt, self._live, lent)[0]

    def live_match(self, prompt: list[int]) -> int:
        """How many of prompt's tokens this slot's working caches hold (between requests): choosing a slot by it
        keeps a conversation where it is."""
        return 0 if self._live is None else common_prefix(self._live.ids, prompt)

    # --- per request ------------------------------------------------------------------------------

    def acquire(self, prompt: list[int], enabled: bool = True, lent: Sequence[PrefixKV] = ()) -> Reuse:
        """Set the working caches to the longest reusable prefix of `prompt`: of this slot's conversation, a stored
        one, or `lent` (other slots' requests in flight: `lend`). Not `enabled`: the request neither reuses nor
        stores, and starts from empty caches."""
        live, self._live = self._live, None  # until release(), the working caches are the request's
        self._caching, self._pending = enabled, []
        if not enabled:
            if live is not None:
                self._keep(live, 0)
            self._reset()
            return Reuse()
        position, source, checkpoint = self._best(prompt, live, lent)
        if source is not None and source is live:
            self._keep(live, position)
            self._truncate(position, checkpoint)
        else:
            if live is not None:
                self._keep(live, 0)
            if source is None:
                self._reset()
            else:
                assert checkpoint is not None or source.lender is not None
                self._load(source, position, checkpoint)
        if source is not None:
            self._pending = [c for c in source.checkpoints if c.position <= position]
        self._last_checkpoint = position
        logits = None
        if position == len(prompt):
            assert checkpoint is not None and checkpoint.logits is not None
            # A copy: sampling and grammar masks work on the logits in place.
            logits = checkpoint.logits.to(self.cache.device, copy=True)
        self.stats.requests += 1
        self.stats.hits += position > 0
        self.stats.prompt_tokens += len(prompt)
        self.stats.cached_tokens += position
        self.store.fit()
        log.debug("prefix cache: %d of %d prompt tokens cached (%s)", position, len(prompt),
                  "none" if source is None else "live" if source is live else
                  "stored" if source.lender is None else "another slot's")
        return Reuse(position, logits)

    def prefilled(self, position: int, logits: torch.Tensor | None) -> None:
        """Called after each prefill chunk, with the cache at `position`; `logits` [vocab] of the last
        prompt token after the last chunk (a prompt end), None before."""
        if not self._caching:
            return
        every = self.config.checkpoint_every
        if logits is None and position // every == self._last_checkpoint // every:
            return
        self._last_checkpoint = position
        self._pending = [c for c in self._pending if c.position != position]
        self._pending.append(RingCheckpoint(
            position, self.cache.ring_snapshot(self._host),
            logits.to(self._host, copy=True) if logits is not None else None, self._drafter_rings(position),
        ))
        self.store.thin(self._pending)
        self.store.fit()

    def release(self, ids: list[int]) -> None:
        """The request is over and the working caches hold exactly `ids`."""
        if not self._caching:
            return
        if self.cache.length != len(ids) or (self.drafter_cache is not None and self.drafter_cache.length != len(ids)):
            raise RuntimeError(f"the caches hold {self.cache.length} tokens, not the {len(ids)} recorded")
        self._live = PrefixKV(list(ids), [c for c in self._pending if c.position <= len(ids)],
                              last_used=next(self.store.clock))
        self._pending, self._caching = [], False
        self.store.fit()

    # --- choosing and loading a prefix ------------------------------------------------------------

    def _best(self, prompt: list[int], live: PrefixKV | None,
              lent: Sequence[PrefixKV] = ()) -> tuple[int, PrefixKV | None, RingCheckpoint | None]:
        """(position, source, checkpoint): the most tokens any state can serve. The last prompt token is
        run again for its logits unless a prompt-end checkpoint kept them. Ties go to the live state, then to
        stored ones. A checkpoint of None: the source's rings as they are (rolled back within their reach)."""
        best: tuple[int, PrefixKV | None, RingCheckpoint | None] = (0, None, None)
        for entry in ([live] if live is not None else []) + self.store.entries + list(lent):
            common = common_prefix(entry.ids, prompt)
            if common <= best[0]:
                continue
            if entry is live or entry.lender is not None:
                limit = min(common, len(prompt) - 1)
                rings = (self.cache, self.drafter_cache) if entry is live else (entry.lender, entry.drafter_lender)
                if limit > best[0] and all(c is None or c.rings_hold(limit) for c in rings):
                    best = (limit, entry, None)
            for checkpoint in reversed(entry.checkpoints):
                usable = checkpoint.position < len(prompt) or checkpoint.logits is not None
                if checkpoint.position <= common and usable:
                    if checkpoint.position > best[0]:
                        best = (checkpoint.position, entry, checkpoint)
                    break
        return best

    def _truncate(self, position: int, checkpoint: RingCheckpoint | None) -> None:
        rollback = self.cache.rings_hold(position)
        assert rollback or checkpoint is not None
        self.cache.restore(position, None, None if rollback else checkpoint.ring)
        if self.drafter_cache is not None:
            rollback = self.drafter_cache.rings_hold(position)
            assert rollback or checkpoint is not None
            self.drafter_cache.restore(position, None, None if rollback else self._checkpoint_drafter(checkpoint))

    def _load(self, entry: PrefixKV, position: int, checkpoint: RingCheckpoint | None) -> None:
        self.cache.restore(position, entry.full, entry.lender.ring_state() if checkpoint is None else checkpoint.ring)
        if self.drafter_cache is not None:
            if entry.drafter is None:
                raise RuntimeError("a stored conversation lacks the drafter's context K/V")
            if checkpoint is None:
                assert entry.drafter_lender is not None
                rings = entry.drafter_lender.ring_state()
            else:
                rings = self._checkpoint_drafter(checkpoint)
            self.drafter_cache.restore(position, entry.drafter, rings)
        if entry.lender is not None:
            self.stats.lent += 1
            return
        self.stats.restored += 1
        if self._worth_keeping(len(entry.ids), position):
            entry.last_used = next(self.store.clock)
        else:
            self.store.entries.remove(entry)  # moved into the working cache; stored again when it is left

    def _drafter_rings(self, position: int) -> RingSnapshot | None:
        """A copy of the drafter's rings for a checkpoint at `position`, which its cache must be at."""
        if self.drafter_cache is None:
            return None
        if self.drafter_cache.length != position:
            raise RuntimeError(f"the drafter's cache holds {self.drafter_cache.length} tokens, not {position}")
        return self.drafter_cache.ring_snapshot(self._host)

    @staticmethod
    def _checkpoint_drafter(checkpoint: RingCheckpoint) -> RingSnapshot:
        if checkpoint.drafter_ring is None:
            raise RuntimeError("a checkpoint lacks the drafter's rings")
        return checkpoint.drafter_ring

    def _reset(self) -> None:
        self.cache.reset()
        if self.drafter_cache is not None:
            self.drafter_cache.reset()

    # --- storing and evicting ---------------------------------------------------------------------

    def _worth_keeping(self, length: int, position: int) -> bool:
        lost = length - position
        return length >= self.config.min_tokens and lost >= max(self.config.min_tokens, length // 4)

    def _keep(self, live: PrefixKV, position: int) -> None:
        """Store a copy of the live conversation before the working caches drop what follows `position`,
        when that is a large part of it."""
        n = len(live.ids)
        if not self._worth_keeping(n, position) or self.config.max_entries == 0:
            return
        # A stored conversation this one repeats (restored from it in part, its greedy turn written again) is
        # already what a copy would be: it counts as used now instead
        stored = next((entry for entry in self.store.entries if entry.ids == live.ids), None)
        if stored is not None:
            stored.last_used = max(stored.last_used, live.last_used)
            return
        per_token = sum(t[0].nbytes for t in self.cache.full_state())
        if self.drafter_cache is not None:
            per_token += sum(t[0].nbytes for t in self.drafter_cache.full_state())
        on_device = n * per_token <= self.config.device_bytes - self.store.usage()[1]
        where = self.cache.device if on_device else self._host
        checkpoints = list(live.checkpoints)
        if not checkpoints or checkpoints[-1].position != n:
            checkpoints.append(RingCheckpoint(n, self.cache.ring_snapshot(self._host),
                                              drafter_ring=self._drafter_rings(n)))
            self.store.thin(checkpoints)
        entry = PrefixKV(
            list(live.ids), checkpoints, self.cache.full_snapshot(n, where),
            self.drafter_cache.full_snapshot(n, where) if self.drafter_cache is not None else None,
            on_device, live.last_used,
        )
        self.store.entries.append(entry)
        self.stats.stored += 1
        log.debug("prefix cache: stored a conversation of %d tokens (%s)", n, "device" if on_device else "host")

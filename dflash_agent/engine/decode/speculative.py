"""Decoding one request: prefill, then steps that verify a drafted block in one target forward.

A step runs [anchor, d1..dk] through the target, where the anchor is the last committed token (not
yet in the KV cache) and d1..dk come from the DFlash drafter or from a prompt-lookup n-gram match.
The longest prefix of drafts the target agrees with is kept, plus one token sampled from the target
at the first disagreement (the "bonus"), so each step commits 1..k+1 tokens. k = 0 is a plain
autoregressive step. Verification is lossless: greedy keeps exactly the target's argmax path, and
sampling uses rejection sampling against the draft distribution, so outputs follow the target's
distribution whatever the drafter proposes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from ..cache.drafter_cache import DrafterCache
from ..cache.kv_cache import KVCache
from ..engine_config import SpecConfig
from ..limits import FEED_EVERY, PREFILL_CHUNK, SHORT_PREFILL
from ..model.drafter import Drafter
from ..model.gemma import ForwardOutput, run_to_end
from ..model.mtp import MtpDrafter
from ..runner import StepRunner
from ..types import SpecStats
from .draft_policy import PLAIN, Arm, DraftPolicy, Source
from .sampling import Sampler

log = logging.getLogger(__name__)

NGRAM_MAX_DRAFT = 64  # prompt lookup's longest draft: a copied file continues for as long as the match holds


class Matcher(Protocol):
    """Grammar state for constrained decoding (engine/decode/grammar.py's GrammarMatcher)."""

    def mask(self, logits: torch.Tensor) -> None: ...
    def accept(self, token: int) -> bool: ...
    def rollback(self, n: int) -> None: ...




class NgramIndex:
    """The most recent earlier occurrence of each short n-gram in the sequence (and of the last `copy_n` tokens),
    kept incrementally, so proposing the continuation of the longest suffix match costs O(ngram_max) per step."""

    def __init__(self, min_n: int, max_n: int, copy_n: int | None = None, memory: CopyMemory | None = None) -> None:
        self.min_n, self.max_n, self.copy_n = min_n, max_n, copy_n
        self.memory = memory
        self._sizes = [*range(min_n, max_n + 1), *([copy_n] if copy_n and copy_n > max_n else [])]
        self.ids: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end index (exclusive) of its latest occurrence
        self._pending: dict[tuple[int, ...], int] = {}

    def extend(self, ids: list[int]) -> None:
        for token in ids:
            # An n-gram ending at the newest token must not match itself, so each is published one
            # token late: the suffix lookup then finds only strictly earlier occurrences.
            self._last.update(self._pending)
            self._pending = {}
            self.ids.append(token)
            end = len(self.ids)
            for n in self._sizes:
                if end >= n:
                    self._pending[tuple(self.ids[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        end = len(self.ids)
        for n in range(self.max_n, self.min_n - 1, -1):
            if end < n:
                continue
            at = self._last.get(tuple(self.ids[end - n :]))
            if at is not None:
                return self._continuation(at, k)
        return []

    def _continuation(self, at: int, k: int) -> list[int]:
        """k tokens from index `at` of the sequence as the drafts extend it: where the match is the tail of a
        repeat (a line the output keeps writing), the copy runs past the end into the drafts themselves, so a
        repeat of period p drafts k tokens rather than p."""
        end, draft = len(self.ids), []
        for i in range(at, at + k):
            draft.append(self.ids[i] if i < end else draft[i - end])
        return draft

    def copy(self, k: int) -> list[int]:
        """The continuation of the latest earlier occurrence of the last copy_n tokens ([] where there is none), as
        long as the match: a copy under way matches further back with every step, so its drafts grow to k, where
        records that only share a layout (JSON, logs) match a little past copy_n and get short ones. Where the
        sequence itself has no match as long as k, an earlier request's output may have one (`memory`)."""
        end, n = len(self.ids), self.copy_n
        at = self._last.get(tuple(self.ids[end - n :])) if n and end >= n else None
        own: list[int] = []
        if at is not None:
            matched = n
            while matched < k and at - matched > 0 and self.ids[at - matched - 1] == self.ids[end - matched - 1]:
                matched += 1
            own = self._continuation(at, min(k, matched))
        if len(own) >= k or self.memory is None or not n or end < n:
            return own
        remembered = self.memory.copy(self.ids, k)
        return remembered if len(remembered) > len(own) else own


class CopyMemory:
    """What earlier requests wrote, each output with the prompt tokens just before it, indexed by its windows of n
    tokens: a request that writes what an earlier one wrote (a retried or regenerated answer, a sub-agent redoing a
    step, the same file written again in a new conversation) drafts it as a copy. llama.cpp's ngram-mod keeps its
    table across requests likewise. Shared by a scheduler's slots and touched only by its worker thread; holds at
    most `max_tokens`, dropping the oldest outputs first."""

    LEAD = 64  # prompt tokens kept before an output: a match at the output's start is already this long

    def __init__(self, n: int, max_tokens: int = 1 << 16) -> None:
        self.n, self.max_tokens = n, max_tokens
        self._sequences: dict[int, tuple[list[int], int]] = {}  # (tokens, where the output starts), oldest first
        self._next = 0
        self.tokens = 0  # held
        self._last: dict[int, tuple[int, int]] = {}  # hash of a window -> (sequence, end) of its latest occurrence

    def add(self, sequence: list[int], output_start: int) -> None:
        """Remember the output sequence[output_start:] of a finished request."""
        if len(sequence) <= output_start:
            return
        begin = max(0, output_start - self.LEAD, len(sequence) - self.max_tokens)
        kept, first = sequence[begin:], max(0, output_start - begin)  # first: where the output starts in `kept`
        while self._sequences and self.tokens + len(kept) > self.max_tokens:
            self._drop_oldest()
        key, self._next = self._next, self._next + 1
        self._sequences[key] = (kept, first)
        self.tokens += len(kept)
        self._index(key)

    def _index(self, key: int) -> None:
        seq, first = self._sequences[key]
        for end in range(max(self.n, first), len(seq)):  # windows with output after them
            self._last[hash(tuple(seq[end - self.n:end]))] = (key, end)

    def _drop_oldest(self) -> None:
        self.tokens -= len(self._sequences.pop(next(iter(self._sequences)))[0])
        if len(self._last) > 2 * self.max_tokens:  # a dropped output's windows stay until they are many (lookups
            self._last = {}                         # skip them)
            for key in self._sequences:
                self._index(key)

    def copy(self, ids: list[int], k: int) -> list[int]:
        """The continuation of ids' last n tokens in a remembered output, as long as the match ([] where none)."""
        tail = ids[len(ids) - self.n:]
        found = self._last.get(hash(tuple(tail)))
        held = self._sequences.get(found[0]) if found is not None else None
        if held is None:  # no such window, or only in a dropped output
            return []
        seq = held[0]
        at = found[1]
        if seq[at - self.n:at] != tail:  # a hash collision
            return []
        matched, end = self.n, len(ids)
        while matched < k and at - matched > 0 and seq[at - matched - 1] == ids[end - matched - 1]:
            matched += 1
        return seq[at:at + min(k, matched)]


@dataclass
class _Proposal:
    source: Source
    tokens: list[int]
    probs: torch.Tensor | None = None  # [k, V] draft distributions when sampling; None = one-hot drafts


@dataclass
class DraftBlock:
    """One request's anchor and drafts, planned for the target to verify (RequestDecoder.plan)."""

    ids: torch.Tensor  # [1 + k]: the anchor and the drafts
    logits_at: torch.Tensor  # every row's logits are verified
    proposal: _Proposal
    arm: Arm | None  # the controller's choice, to credit with the step's time (None: not its choice)
    start: int  # the cache's length before the step
    started: float  # perf_counter when it was planned
    greedy: bool = False  # greedy without a grammar: the target's picks suffice (GemmaModel.forward's `greedy`)


class RequestDecoder:
    """The state of one request on the target (and drafter) caches: `prefill_chunks`, then `first_token`, then
    `plan` and `commit` around each target step (the scheduler's Task drives them)."""

    def __init__(
        self,
        target: StepRunner,
        cache: KVCache,
        sampler: Sampler,
        drafter: Drafter | MtpDrafter | None = None,
        drafter_cache: DrafterCache | None = None,
        matcher: Matcher | None = None,
        spec: SpecConfig | None = None,
        controller: DraftPolicy | None = None,
        memory: CopyMemory | None = None,
    ) -> None:
        """memory: earlier requests' outputs to draft copies from (and this one's to remember when it finishes)."""
        self.target, self.cache, self.sampler = target, cache, sampler
        self.matcher = matcher
        self.spec = spec or SpecConfig()
        # With speculation off a loaded drafter is not fed either: no features are captured.
        # A Gemma 4 assistant (MTP) drafts from the target's cache and last hidden state; DFlash from its own cache.
        self.mtp = drafter if self.spec.enabled and isinstance(drafter, MtpDrafter) else None
        self.drafter = drafter if self.spec.enabled and self.mtp is None else None
        self.drafter_cache = drafter_cache if self.drafter is not None else None
        self.stats = SpecStats()
        model_drafter = self.mtp or self.drafter
        self.capture = model_drafter.capture_layers if model_drafter is not None else ()
        self._mtp_hidden: torch.Tensor | None = None  # the target's last committed row, for the assistant
        # a block's rows must come out as decode steps give them (and within what the rings can roll back)
        longest = target.step_rows(cache) - 1
        if self.mtp is not None:
            max_draft = self.mtp.config.draft_steps
        else:
            max_draft = (self.drafter.config.block_size - 1) if self.drafter is not None else 15
        max_lookup = NGRAM_MAX_DRAFT
        if self.spec.block is not None:
            max_draft = max_lookup = self.spec.block - 1
        use_ngram = self.spec.enabled and self.spec.ngram
        # The adaptive controller outlives the request: the engine passes it to the next one.
        self.shared_controller = controller or DraftPolicy(
            min(max_draft, longest),
            drafter=model_drafter is not None,
            ngram=use_ngram,
            fixed=None if self.spec.block is None else min(max_draft, longest),
            max_lookup=min(max_lookup, longest),
            copy=bool(self.spec.copy_match),
            drafter_source=Source.MTP if self.mtp is not None else Source.DFLASH,
        )
        self.controller = self.shared_controller
        if sampler.params.seed is not None and not sampler.params.greedy and self.spec.block is None:
            # A seeded sample must depend on the seed and the prompt alone, but which drafts get verified
            # (each verification draws from the generator) depends on the adaptive controller's timings;
            # so such a request decodes plainly (a fixed block is deterministic and keeps drafting).
            # The drafter is still fed, for the requests after it.
            self.controller = DraftPolicy(0, drafter=False, ngram=False, fixed=None)
        self.ngram = NgramIndex(self.spec.ngram_min, self.spec.ngram_max, self.spec.copy_match,
                                memory if self.spec.copy_match else None) if use_ngram else None
        self.sequence: list[int] = []  # the prompt and every token committed so far
        self._prompt_len = 0
        self._logits: torch.Tensor | None = None
        # Target features of committed tokens not yet in the drafter's cache: a decode step only queues them,
        # and they go in one call before the drafter next drafts (or when the request ends), so steps that do
        # not draft do not pay for the drafter.
        self._unfed: list[torch.Tensor] = []

    # --- prefill ----------------------------------------------------------------------------------

    def prefill_chunks(
        self,
        prompt_ids: list[int],
        cached: int = 0,
        logits: torch.Tensor | None = None,
        on_chunk: Callable[[int, torch.Tensor | None], None] | None = None,
    ) -> Iterator[float]:
        """Run the prompt through the target (and its features into the drafter's cache) a chunk at a time: yields
        the position after each chunk, and inside a chunk whose layers run one at a time (StepRunner.forward_steps)
        its fraction done after each layer, so a scheduler can run other requests' steps between chunks and layers,
        or drop the rest (the caches then hold the chunks done, and `sequence` their ids; a chunk dropped between two
        of its layers first runs its other layers).

        cached: the caches already hold the prompt's first `cached` tokens (a reused prefix; 0 resets them).
        logits: the last prompt token's logits [vocab], needed when all of the prompt is cached.
        on_chunk(position, logits): called after each chunk; logits [vocab] after the last one, else None.
        """
        self._mtp_hidden = None  # set by the prompt's last chunk, or by the first step after a full cache hit
        if cached == 0:
            self.cache.reset()
            if self.drafter_cache is not None:
                self.drafter_cache.reset()
        if self.cache.length != cached or (self.drafter_cache is not None and self.drafter_cache.length != cached):
            raise RuntimeError(f"the caches do not hold the {cached} reused prompt tokens")
        self.sequence = list(prompt_ids[:cached])
        self._prompt_len = len(prompt_ids)
        if cached == len(prompt_ids):
            if logits is None:
                raise ValueError("a fully cached prompt needs its last token's logits")
            self._logits = logits[None]
        # Chunks end at multiples of PREFILL_CHUNK whatever the reused prefix, so checkpoints land on them.
        bounds = [cached, *range((cached // PREFILL_CHUNK + 1) * PREFILL_CHUNK, len(prompt_ids), PREFILL_CHUNK)]
        bounds = [*bounds, len(prompt_ids)] if cached < len(prompt_ids) else []
        layers = self.target.config.num_layers
        for start, end in itertools.pairwise(bounds):
            # a short chunk in pieces the C decode layers take: a prefill GEMM pays for dequantizing every weight
            short = end - start < SHORT_PREFILL and self.target.decodes_on_c(self.cache)
            step = self.target.step_rows(self.cache) if short else end - start
            dropped = False
            for piece in range(start, end, step):
                piece_end = min(piece + step, end)
                chunk = torch.tensor(prompt_ids[piece:piece_end], device=self.target.device)
                steps = self.target.forward_steps(chunk, self.cache, capture=self.capture)
                while True:
                    try:
                        done = next(steps)
                    except StopIteration as finished:
                        out = finished.value
                        break
                    try:  # between two layers of a piece: a scheduler may serve others here; the piece is the same
                        yield piece + (piece_end - piece) * done / layers
                    except GeneratorExit:
                        # dropped inside a piece: it runs to its end all the same, as the sliding rings hold the
                        # piece's first keys in place of the window before it (and the prefix cache wants that)
                        out, dropped = run_to_end(steps), True
                        break
                self._queue_features(out.captured, chunk.shape[0])
                if dropped:
                    break
            done_to = piece_end if dropped else end
            self._feed_drafter()
            self._logits = out.logits
            self.sequence.extend(prompt_ids[start:done_to])
            if on_chunk is not None:
                on_chunk(done_to, out.logits[0] if done_to == len(prompt_ids) else None)
            if dropped:
                return
            if end < len(prompt_ids):
                yield end
        if self.ngram is not None:
            self.ngram.extend(prompt_ids)
        yield len(prompt_ids)

    def finish(self, consumed: int) -> list[int]:
        """Cut the caches back to the tokens the caller consumed (generation may stop inside a verified
        block) and return the ids they hold: the prompt and the generated tokens whose keys were computed.
        consumed: how many generated tokens the caller took; the token generation stopped at (a stop token, say)
        counts, and is kept when its keys were computed."""
        taken = self._prompt_len + consumed
        n = min(self.cache.length, len(self.sequence), taken)
        self.cache.rollback(n)
        self._feed_drafter()
        if self.drafter_cache is not None:
            self.drafter_cache.rollback(n)
        if self.ngram is not None and self.ngram.memory is not None:
            self.ngram.memory.add(self.sequence[:n], self._prompt_len)
        return self.sequence[:n]

    # --- decoding ---------------------------------------------------------------------------------

    def first_token(self) -> int:
        """The token after the prompt, from the prefill's logits: the anchor of the first step."""
        assert self._logits is not None, "prefill first"
        anchor = self._pick(self._logits[0])
        self.sequence.append(anchor)
        return anchor

    def plan(self, anchor: int, budget: int, draft: bool = True) -> DraftBlock:
        """A step's block, [anchor, drafts...], for the target to run over this request's cache (alone or beside
        other requests' blocks: StepRunner.forward_groups); `commit` takes its output. budget: the most tokens
        the step may commit. draft False: a plain step, which the controller neither picks nor learns from (the
        scheduler's choice for a batch of requests)."""
        start = self.cache.length
        room = min(budget - 1, self.cache.max_len - start - 1)
        if self.ngram is not None:
            self.ngram.extend([anchor])
        arm = self.controller.choose(self._ngram_ready(room), self._copy_ready(room)) if draft else None
        if arm is None:
            ids = torch.tensor([anchor], device=self.target.device)
            return DraftBlock(ids, torch.arange(1, device=ids.device), _Proposal(Source.AR, []), None, start,
                              time.perf_counter(), self._greedy)
        if arm.source is Source.DFLASH:
            self._feed_drafter()  # the backlog of plain steps, not this step's cost
        started = time.perf_counter()
        k = min(arm.k, room)
        if k == 0:
            arm = PLAIN  # no room left to draft: this step measures plain decoding
        proposal = self._propose(arm.source, anchor, k) if k > 0 else _Proposal(Source.AR, [])
        ids = torch.tensor([anchor, *proposal.tokens], device=self.target.device)
        return DraftBlock(ids, torch.arange(ids.shape[0], device=ids.device), proposal, arm, start, started,
                          self._greedy)

    def commit(self, planned: DraftBlock, out: ForwardOutput) -> list[int]:
        """Verify the planned block against the target's output over it; returns the 1..k+1 tokens committed."""
        proposal = planned.proposal
        accepted, bonus = self._verify(proposal, out)
        keep = 1 + accepted
        self.cache.rollback(planned.start + keep)
        self._queue_features({i: h[:keep] for i, h in out.captured.items()}, keep)
        new = [*proposal.tokens[:accepted], bonus]
        if self.ngram is not None:
            self.ngram.extend(new[:-1])
        self.sequence.extend(new)
        self.stats.record(proposal.source.value, len(proposal.tokens), accepted)
        if planned.arm is not None:
            self.controller.record(planned.arm, len(new), time.perf_counter() - planned.started)
        return new

    @property
    def _greedy(self) -> bool:
        """Whether a step needs only the target's picks: greedy, and no grammar to mask the logits first."""
        return self.sampler.params.greedy and self.matcher is None

    def _ngram_ready(self, room: int) -> bool:
        return self.ngram is not None and room > 0 and bool(self.ngram.propose(1))

    def _copy_ready(self, room: int) -> int:
        """How long a copy the match supports, up to the longest copy arm's draft (0: none)."""
        if self.ngram is None or room <= 0:
            return 0
        return len(self.ngram.copy(self.controller.longest_copy))

    def _queue_features(self, captured: dict[int, torch.Tensor], n: int) -> None:
        if self.mtp is not None and n > 0:
            self._mtp_hidden = captured[self.mtp.target_layer][n - 1]
            return
        if self.drafter is None or self.drafter_cache is None or n == 0:
            return
        self._unfed.append(torch.cat([captured[i] for i in self.capture], dim=-1))
        if sum(f.shape[0] for f in self._unfed) >= FEED_EVERY:
            self._feed_drafter()

    def _feed_drafter(self) -> None:
        """Bring the drafter's cache up to the target's committed tokens."""
        if self._unfed:
            assert self.drafter is not None and self.drafter_cache is not None
            features = self._unfed[0] if len(self._unfed) == 1 else torch.cat(self._unfed)
            self._unfed = []
            self.drafter.append_context(features, self.drafter_cache)

    # --- proposals --------------------------------------------------------------------------------

    def _propose(self, source: Source, anchor: int, k: int) -> _Proposal:
        if source in (Source.NGRAM, Source.COPY):
            assert self.ngram is not None
            return _Proposal(source, self.ngram.propose(k) if source is Source.NGRAM else self.ngram.copy(k))
        if source is Source.MTP:
            return self._propose_mtp(anchor, k)
        assert self.drafter is not None and self.drafter_cache is not None
        self._feed_drafter()
        config = self.drafter.config
        ids = torch.tensor([anchor] + [config.mask_token_id] * k, device=self.target.device)
        embeds = self.target.model.embed_tokens.weight[ids] * config.input_embedding_scale
        hidden = self.drafter.draft(embeds, self.drafter_cache)
        if self._greedy and self.drafter.config.output_multiplier > 0:
            picks = self.target.draft_picks(hidden[1:])
            if picks is not None:
                return _Proposal(Source.DFLASH, picks)
        logits = self.drafter.logits(hidden[1:], self.target.model.output_weight)
        tokens: list[int] = []
        probs = [] if not self.sampler.params.greedy else None
        for row in logits:
            token = self._draft_token(row, probs)
            if token is None:
                break
            tokens.append(token)
        return self._proposal(Source.DFLASH, tokens, probs)

    def _propose_mtp(self, anchor: int, k: int) -> _Proposal:
        """k steps of the assistant, each fed the token the last one drafted (no drafts before the target has a
        committed row of its own this request: a prompt wholly from the prefix cache)."""
        assert self.mtp is not None
        if self._mtp_hidden is None:
            return _Proposal(Source.MTP, [])
        keys = self.mtp.keys(self.cache)
        hidden, token, position = self.target.model.norm(self._mtp_hidden), anchor, self.cache.length
        tokens: list[int] = []
        probs = [] if not self.sampler.params.greedy else None
        for _ in range(k):
            embed = self.target.embed(torch.tensor([token], device=self.target.device))[0]
            row, hidden = self.mtp.step(embed, hidden, position, keys)
            token = self._draft_token(row, probs)
            if token is None:
                break
            tokens.append(token)
        return self._proposal(Source.MTP, tokens, probs)

    def _draft_token(self, row: torch.Tensor, probs: list[torch.Tensor] | None) -> int | None:
        """A draft from a drafter's logits row [vocab] (its distribution appended to `probs` when sampling), under
        the grammar, which it advances; None where the grammar allows nothing more."""
        if self.matcher is not None:
            # Constrain drafts too, so a grammar-forced block is not rejected for shape alone.
            self.matcher.mask(row)
            if torch.isinf(row).all():
                return None
        if probs is None:
            token = self.sampler.argmax(row)
        else:
            p = self.sampler.probs(row)
            token = self.sampler.draw(p)
            probs.append(p)
        if self.matcher is not None and not self.matcher.accept(token):
            return None
        return token

    def _proposal(self, source: Source, tokens: list[int], probs: list[torch.Tensor] | None) -> _Proposal:
        """The drafts, with the grammar put back to before them (verification advances it again)."""
        if self.matcher is not None and tokens:
            self.matcher.rollback(len(tokens))
        return _Proposal(source, tokens, torch.stack(probs[: len(tokens)]) if probs else None)

    # --- verification -----------------------------------------------------------------------------

    def _pick(self, logits: torch.Tensor) -> int:
        """Sample one token from the target, under the grammar, and advance the grammar."""
        if self.matcher is not None:
            self.matcher.mask(logits)
        token = self.sampler(logits)
        if self.matcher is not None:
            self.matcher.accept(token)
        return token

    def _verify(self, proposal: _Proposal, out: ForwardOutput) -> tuple[int, int]:
        """(accepted drafts, bonus token). out.logits[i] is the target's distribution after the anchor and
        drafts 0..i-1 (or out.tokens[i] its pick, a greedy step's). The grammar advances over exactly the committed
        tokens."""
        if out.tokens is not None:  # greedy, no grammar
            for i, draft in enumerate(proposal.tokens):
                if out.tokens[i] != draft:
                    return i, out.tokens[i]
            return len(proposal.tokens), out.tokens[len(proposal.tokens)]
        logits = out.logits
        for i, draft in enumerate(proposal.tokens):
            row = logits[i]
            if self.matcher is not None:
                self.matcher.mask(row)
            if self.sampler.params.greedy:
                target = self.sampler.argmax(row)
                if target != draft:
                    self._advance(target)
                    return i, target
            else:
                p = self.sampler.probs(row)
                q_draft = 1.0 if proposal.probs is None else float(proposal.probs[i, draft])
                if self.sampler.uniform() * q_draft >= float(p[draft]):
                    # Rejected: draw from the residual max(p - q, 0), renormalized.
                    if proposal.probs is None:
                        residual = p.clone()
                        residual[draft] = 0.0
                    else:
                        residual = (p - proposal.probs[i]).clamp_min(0.0)
                    total = float(residual.sum())
                    token = self.sampler.draw(residual / total if total > 0 else p)
                    self._advance(token)
                    return i, token
            self._advance(draft)
        return len(proposal.tokens), self._pick(logits[len(proposal.tokens)])

    def _advance(self, token: int) -> None:
        if self.matcher is not None and not self.matcher.accept(token):
            raise RuntimeError(f"token {token} was chosen under the grammar mask but the grammar rejects it")

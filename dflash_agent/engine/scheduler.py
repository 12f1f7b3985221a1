"""Several requests at once: N slots, each a KV context of its own, served by one worker thread.

Each turn of the loop admits waiting requests into free slots, runs prompt work worth about one PREFILL_CHUNK, or,
while others decode, about as long as their last step took (at least one piece: a chunk, or a layer of a long one),
the request with the least prompt left first, so a short request is not stuck behind a long one (a request that
arrives meanwhile is admitted and goes first before the next piece); then one step for every decoding request: their
decode rows and verification blocks go through the target in one forward (StepRunner.forward_groups), which reads
each weight once for all of them. Every row is computed alone, so a request's output is what it would be alone, and
so whatever the turns interleave. A running prefill and the decoding requests share the time about evenly, a piece
of prompt at a time; a cancelled request leaves its slot at the next turn; requests past the slots wait in order.

Each slot has its own speculation controller (what pays depends on what the request writes), its own prefix-cache
view of its working caches, and they share the stored conversations (engine.cache.prefix_cache), so a stored
conversation resumes in any free slot; a request goes to the free slot whose caches already hold most of its prompt.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .backends.thread_count import ThreadCount
from .cache.drafter_cache import DrafterCache
from .cache.kv_cache import KVCache
from .cache.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixKV, PrefixStore, Reuse, common_prefix
from .decode import speculative
from .decode.draft_policy import BatchDrafting, DraftPolicy
from .decode.sampling import Sampler, StopStringFilter
from .decode.speculative import CopyMemory, DraftBlock, RequestDecoder, SpecConfig
from .load.tokenizer import IncrementalDetokenizer, Tokenizer
from .model.drafter import Drafter
from .model.gemma import RowGroup
from .model.mtp import MtpDrafter
from .model.packed import cpu_dot, products_in_c, release_cpu_threads
from .progress import ProgressLog
from .runner import StepRunner
from .types import ErrorEvent, FinalEvent, GenerateRequest, SlotInfo, Timings, TokenEvent, Usage

log = logging.getLogger(__name__)

# While other requests decode, a turn's prompt work lasts about as long as their step (at least one piece of it),
# aiming at half its solo speed for a decoding request beside a long prefill, the other half the prefill's (a fixed
# quarter chunk a turn kept it at a few per cent of its speed: a client's side requests crawled). Where one piece,
# a layer of a long chunk, outlasts the step, the decoding request gets less. The step's time is
# followed as a moving average with this weight on the newest.
STEP_TIME_WEIGHT = 0.3


@dataclass
class Job:
    request: GenerateRequest
    emit: Callable[[TokenEvent | FinalEvent | ErrorEvent], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Slot:
    id: int
    cache: KVCache
    drafter_cache: DrafterCache | None
    prefix: PrefixCache | None
    controller: DraftPolicy | None = None  # outlives requests: what it learnt carries to the next
    task: Task | None = None
    last_used: float = 0.0


class Task:
    """One request in a slot, from admission to its final event: prefill chunks, then steps. A request whose prompt
    starts as another's in flight does, further than anything held, first waits for that one's chunks to get there
    (`lender`, `until`), then takes them from its caches (PrefixCache.lend): the shared part is prefilled once."""

    def __init__(self, scheduler: Scheduler, job: Job, slot: Slot, lender: Task | None = None, until: int = 0) -> None:
        req, runner = job.request, scheduler.runner
        self.scheduler, self.job, self.slot = scheduler, job, slot
        self.decoder = RequestDecoder(
            runner, slot.cache, Sampler(req.sampling, runner.device, runner.argmax),
            drafter=scheduler.drafter, drafter_cache=slot.drafter_cache,
            matcher=req.grammar.matcher() if req.grammar is not None else None,
            spec=scheduler.spec, controller=slot.controller, memory=scheduler.copy_memory,
        )
        slot.controller = self.decoder.shared_controller
        self.stop_ids = scheduler.tokenizer.stop_ids | req.stop.token_ids
        self.detok = IncrementalDetokenizer(scheduler.tokenizer)
        self.stops = StopStringFilter(req.stop.strings)
        self.budget = scheduler.n_ctx - len(req.prompt_ids)
        self.max_tokens = self.budget if req.max_tokens is None else min(req.max_tokens, self.budget)
        self.started = time.perf_counter()
        self.progress = ProgressLog(req.request_id, scheduler.progress_every_s)
        self.followers: list[Task] = []  # requests waiting for this one's chunks
        self.lender, self.until = lender, until
        self.taken = False  # whether it took the slot's caches (`start`)
        self.reuse = Reuse()
        self.timings = Timings(prompt_n=len(req.prompt_ids))
        self.prefilled = 0  # the chunks done
        self.prefill_position = 0.0  # counting a chunk's layers done as its fraction
        self.prefill: Iterator[float] | None = None
        self.decode_started = 0.0
        self.generated: list[int] = []
        self.consumed = 0  # generated tokens taken, the one generation stopped at included
        self.anchor: int | None = None
        self.finish: str | None = None
        self.matched: int | str | None = None
        if lender is None:
            self.start()
        else:
            lender.followers.append(self)

    def start(self) -> None:
        """Take the slot's caches at the longest prefix of the prompt held anywhere (this slot's conversation, a
        stored one, another slot's request in flight), and set out to prefill the rest."""
        self.stop_waiting()
        req, prefix = self.job.request, self.slot.prefix
        self.taken = True
        lent = self.scheduler.lent(self.slot) if req.cache_prompt else []
        self.reuse = prefix.acquire(req.prompt_ids, req.cache_prompt, lent) if prefix is not None else Reuse()
        if req.on_prefix is not None:
            req.on_prefix(self.reuse.tokens)
        self.timings = Timings(cache_n=self.reuse.tokens, prompt_n=len(req.prompt_ids) - self.reuse.tokens)
        self.prefilled = self.reuse.tokens
        self.prefill_position = float(self.reuse.tokens)
        self.prefill = self.decoder.prefill_chunks(req.prompt_ids, self.reuse.tokens, self.reuse.logits,
                                                   on_chunk=self._on_chunk)

    def stop_waiting(self) -> None:
        """No longer wait for the lender's chunks (taking the caches, or ending)."""
        if self.lender is not None:
            self.lender.followers.remove(self)
            self.lender = None

    @property
    def waiting(self) -> bool:
        """Waiting for another request's chunks (`lender`): neither prefilling nor decoding yet."""
        return self.lender is not None

    def release_followers(self, position: int | None = None) -> None:
        """Start the requests waiting for this one's chunks up to `position` (None: all of them, as it ends)."""
        for follower in [f for f in self.followers if position is None or f.until <= position]:
            if not follower.job.cancelled.is_set():  # one cancelled ends at the next turn without the caches
                self.scheduler.guard([follower], follower.start)

    @property
    def lendable(self) -> bool:
        """Whether another slot may restore from this request's caches now: its prompt's chunks done and between
        steps (not inside a chunk run a layer at a time), and its prompt meant for the prefix cache."""
        return (self.taken and self.running and self.job.request.cache_prompt and self.slot.prefix is not None
                and (self.prefill is None or self.prefill_position == self.prefilled))

    @property
    def running(self) -> bool:
        """Still in its slot (not failed) with no reason to stop yet."""
        return self.slot.task is self and self.finish is None

    @property
    def prompt_left(self) -> int:
        return len(self.job.request.prompt_ids) - self.prefilled

    def _on_chunk(self, position: int, logits: torch.Tensor | None) -> None:
        self.prefilled = position
        self.prefill_position = float(position)
        if self.slot.prefix is not None:
            self.slot.prefix.prefilled(position, logits)
        self.progress.prefilled(position - self.reuse.tokens, len(self.job.request.prompt_ids) - self.reuse.tokens)
        self.release_followers(position)  # the caches hold this chunk's end now, as they will not after the next

    def prefill_chunk(self) -> float:
        """One chunk of the prompt, or one layer of a long chunk; after the last, the first token. Returns the
        prompt tokens' worth of work it did."""
        assert self.prefill is not None
        before, self.prefill_position = self.prefill_position, next(self.prefill)
        work = self.prefill_position - before
        if self.prefill_position < len(self.job.request.prompt_ids):
            return work
        self.timings.prompt_ms = (time.perf_counter() - self.started) * 1e3
        self.decode_started = time.perf_counter()
        self.progress.decoding()
        if self.max_tokens <= 0:
            self.finish = "length"
        else:
            self.push([self.decoder.first_token()])
        # Only now: `slot_info`, read from another thread, calls a slot "decoding" once its first token is out.
        self.prefill = None
        return work

    def plan(self, draft: bool) -> DraftBlock:
        assert self.anchor is not None
        return self.decoder.plan(self.anchor, self.max_tokens - len(self.generated), draft)

    def commit(self, planned: DraftBlock, out) -> int:
        """Verify the step's output; returns the tokens it committed."""
        new = self.decoder.commit(planned, out)
        self.push(new)
        return len(new)

    def push(self, tokens: list[int]) -> None:
        """Hand out committed tokens until a stop condition; sets `finish` when one holds."""
        for token in tokens:
            if self.job.cancelled.is_set():
                self.finish = "cancelled"
                return
            self.consumed += 1
            if token in self.stop_ids:
                self.finish, self.matched = "stop", token
                return
            self.generated.append(token)
            self.progress.generated(len(self.generated), self.max_tokens)
            text, self.matched = self.stops.push(self.detok.push([token]))
            self.job.emit(TokenEvent([token], text))
            if self.matched is not None:
                self.finish = "stop"
                return
            if len(self.generated) >= self.max_tokens:
                self.finish = "length"
                return
        self.anchor = tokens[-1]

    def close(self) -> FinalEvent:
        """The slot's caches handed back, the held-back text emitted, and the final event to emit once the slot is
        free (a caller that reads the slots after its final event finds it idle)."""
        req = self.job.request
        self.stop_waiting()  # cancelled while it waited: the slot's caches were never taken
        if self.prefill is not None or not self.taken:  # cancelled before the prompt was in
            if self.prefill is not None:
                self.prefill.close()
            self.finish = "cancelled"
        if not isinstance(self.matched, str) and self.decode_started:
            # Bytes the detokenizer held back, then whatever the stop filter held back.
            text, hit = self.stops.push(self.detok.flush())
            tail = text if hit else text + self.stops.flush()
            if hit:
                self.finish, self.matched = "stop", hit
            if tail:
                self.job.emit(TokenEvent([], tail))
        if self.taken:
            cached_ids = self.decoder.finish(self.consumed)
            if self.slot.prefix is not None:
                self.slot.prefix.release(cached_ids)
        timings = self.timings
        if self.decode_started:
            timings.predicted_n = len(self.generated)
            timings.predicted_ms = (time.perf_counter() - self.decode_started) * 1e3
        timings.prompt_per_second = _rate(timings.prompt_n, timings.prompt_ms)
        timings.predicted_per_second = _rate(timings.predicted_n, timings.predicted_ms)
        stats = self.decoder.stats
        timings.draft_n, timings.draft_n_accepted = stats.drafted, stats.accepted
        usage = Usage(len(req.prompt_ids), len(self.generated), cached_tokens=self.reuse.tokens)
        finish = self.finish or "length"
        context_full = finish == "length" and (req.max_tokens is None or req.max_tokens > self.budget)
        return FinalEvent(finish, usage, timings, self.matched, stats, context_full)


class Scheduler:
    """The worker's loop (see the module doc). `submit` from any thread; `run` on the worker thread."""

    def __init__(self, runner: StepRunner, tokenizer: Tokenizer, n_ctx: int, parallel: int, kv_dtype: str,
                 drafter: Drafter | MtpDrafter | None, spec: SpecConfig, prefix_cache: PrefixCacheConfig | None,
                 progress_every_s: float) -> None:
        self.runner, self.tokenizer, self.n_ctx = runner, tokenizer, n_ctx
        self.drafter, self.spec = drafter, spec
        self.progress_every_s = progress_every_s
        store = PrefixStore(prefix_cache) if prefix_cache is not None else None
        self.prefix_stats = store.stats if store is not None else None
        self.slots: list[Slot] = []
        for i in range(parallel):
            cache = runner.new_cache(n_ctx, kv_dtype)
            drafter_cache = drafter.new_cache(n_ctx) if drafter is not None else None
            # The drafter's cache is fed (and so worth keeping) only while speculation is on.
            fed = drafter_cache if spec.enabled else None
            prefix = PrefixCache(prefix_cache, cache, fed, store) if store is not None else None
            self.slots.append(Slot(i, cache, drafter_cache, prefix))
        self.capture = drafter.capture_layers if drafter is not None and spec.enabled else ()
        self.batch_drafting = BatchDrafting()
        self.step_seconds = 0.0  # the decoding requests' step, a moving average: the prompt work beside them
        # the CPU kernels' thread count per step (None: not the CPU kernels, or a single core)
        kernels = cpu_dot() if runner.device.type == "cpu" else None
        self.thread_count = ThreadCount(kernels, torch.get_num_threads(),
                                        torch_follows=products_in_c(runner.model.matmul_weights(experts=True))) \
            if kernels is not None and torch.get_num_threads() > 1 else None
        # what every slot's requests wrote, for copies across requests (the worker thread alone touches it)
        self.copy_memory = CopyMemory(spec.copy_match) if spec.enabled and spec.ngram and spec.copy_match else None
        self._inbox: queue.Queue[Job | None] = queue.Queue()
        self._waiting: deque[Job] = deque()
        self._closing = False

    def submit(self, job: Job | None) -> None:
        """Queue a job (None: stop the loop, ending every request as cancelled)."""
        self._inbox.put(job)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot (an estimate read from another thread)."""
        return len(self._waiting) + self._inbox.qsize()

    def slot_info(self) -> list[SlotInfo]:
        """What each slot is doing (read from another thread: a snapshot that may be a step old)."""
        infos = []
        for slot in self.slots:
            task = slot.task
            if task is None:
                infos.append(SlotInfo(slot.id, "idle"))
                continue
            req = task.job.request
            decoding = task.decode_started and task.prefill is None
            elapsed = time.perf_counter() - task.decode_started if decoding else 0.0
            infos.append(SlotInfo(
                slot.id, "decoding" if decoding else "prefilling", req.request_id, len(req.prompt_ids),
                task.reuse.tokens, task.prefilled, len(task.generated),
                len(task.generated) / elapsed if elapsed > 0 else 0.0, req.prompt_ids))
        return infos

    @torch.inference_mode()
    def run(self) -> None:
        while not self._closing or any(s.task for s in self.slots):
            self._take(block=not self._waiting and not any(s.task for s in self.slots))
            self._admit()
            self._turn()

    def _take(self, block: bool) -> None:
        """Move submitted jobs to the waiting line, waiting for one when there is nothing else to do."""
        if block:  # idle: this thread's OpenMP threads end rather than wait (kernels.cpu.cpu_dot)
            release_cpu_threads(self.runner.device)
        while True:
            try:
                job = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if job is None:
                self._closing = True
                for task in (s.task for s in self.slots if s.task is not None):
                    task.job.cancelled.set()
                for job in self._waiting:
                    job.cancelled.set()
            else:
                self._waiting.append(job)
                if self._closing:
                    job.cancelled.set()

    def _admit(self) -> None:
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled.is_set():
                self._waiting.popleft()
                job.emit(FinalEvent("cancelled", Usage(len(job.request.prompt_ids), 0), Timings()))
                continue
            free = [s for s in self.slots if s.task is None]
            if not free:
                return
            self._waiting.popleft()
            prompt = job.request.prompt_ids
            # the slot whose caches hold most of the prompt; else the one left alone longest
            slot = max(free, key=lambda s: (s.prefix.live_match(prompt) if s.prefix is not None else 0,
                                            -s.last_used))
            try:
                slot.task = Task(self, job, slot, *self._lender_for(job, slot))
            except Exception as exc:  # noqa: BLE001 - surfaced to the caller; the others keep running
                self._fail(job, slot, exc)

    def lent(self, slot: Slot) -> list[PrefixKV]:
        """The other slots' requests in flight whose caches `slot` may restore from now (PrefixCache.lend)."""
        return [task.slot.prefix.lend(task.job.request.prompt_ids[:task.prefilled])
                for task in self._tasks() if task.slot is not slot and task.lendable]

    def _lender_for(self, job: Job, slot: Slot) -> tuple[Task | None, int]:
        """(a request still prefilling, the chunk end of its up to which `job`'s prompt is the same), where that
        gives `job` more than anything held now: `job` then waits for it rather than prefill the same tokens (two
        sub-agents with one long system prompt). Else (None, 0)."""
        request = job.request
        if slot.prefix is None or not request.cache_prompt:
            return None, 0
        prompt = request.prompt_ids
        held = slot.prefix.reusable(prompt, self.lent(slot))
        best: tuple[Task | None, int] = (None, held)
        for task in self._tasks():
            if (task.waiting or task.prefill is None or not task.running or not task.job.request.cache_prompt
                    or task.slot.prefix is None):
                continue
            # where its chunks end (multiples of PREFILL_CHUNK, as prefill_chunks cuts them), within the prompts'
            # common part and short of this prompt's last token, whose logits this request computes itself
            shared = min(common_prefix(task.job.request.prompt_ids, prompt), len(prompt) - 1)
            until = shared // speculative.PREFILL_CHUNK * speculative.PREFILL_CHUNK
            # worth it while what it has left to get there is at most twice what this request saves: all of it
            # when it holds nothing, not a long wait for a few tokens more than it holds
            if until > max(best[1], task.prefilled) and until - task.prefilled <= 2 * (until - held):
                best = (task, until)
        return best if best[0] is not None else (None, 0)

    def _turn(self) -> None:
        """Prefill chunks, then one step of every decoding request."""
        for task in self._tasks():
            if task.job.cancelled.is_set() and task.finish is None:
                task.finish = "cancelled"
        # prompt work of about one PREFILL_CHUNK per turn (while others decode, about their step's time), shortest
        # prompt first: several short prompts go in together, and a long one holds the decoding requests back by
        # about one step's time. A long chunk runs a layer at a time, and a request that arrives meanwhile is
        # admitted before the next layer: its prompt, shorter, goes first, so its first token waits for one layer
        # of the long chunk, not all of them.
        decoding_any = any(t.running and t.prefill is None and not t.waiting for t in self._tasks())
        budget = float(speculative.PREFILL_CHUNK)
        until = time.perf_counter() + self.step_seconds if decoding_any else math.inf
        pieces = 0
        while budget > 0 and (pieces == 0 or time.perf_counter() < until):
            pieces += 1
            prefilling = [t for t in self._tasks() if t.running and t.prefill is not None
                          and not t.job.cancelled.is_set()]
            if not prefilling:
                break
            task = min(prefilling, key=lambda t: t.prompt_left)
            work: list[float] = []

            def chunk(t: Task = task) -> None:
                self.guard([t], lambda: work.append(t.prefill_chunk()))

            if self.thread_count is not None:
                self.thread_count.on(self.thread_count.preferred(), chunk)
            else:
                chunk()
            budget -= max(1.0, work[0] if work else 0.0)
            self._take(block=False)
            self._admit()
        tasks = self._tasks()
        decoding = [t for t in tasks if t.running and t.prefill is None and t.anchor is not None]
        if decoding:
            self._step(decoding)
        for task in tasks:
            if task.finish is not None and task.slot.task is task:
                final: list[FinalEvent] = []
                if self.guard([task], lambda t=task: final.append(t.close())):
                    self._free(task.slot)
                    task.job.emit(final[0])

    def _tasks(self) -> list[Task]:
        return [s.task for s in self.slots if s.task is not None]

    def _step(self, tasks: list[Task]) -> None:
        # alone, a request's own controller decides what to draft; in a batch, drafting must pay for the batch
        draft = len(tasks) == 1 or (self.spec.enabled and self.batch_drafting.choose(len(tasks)))
        started = time.perf_counter()
        planned = []
        for task in tasks:
            self.guard([task], lambda t=task: planned.append((t, t.plan(draft))))
        if not planned:
            return
        groups = [RowGroup(p.ids, t.slot.cache, p.logits_at, p.greedy) for t, p in planned]
        committed = []

        def forward() -> None:
            outs = self.runner.forward_groups(groups, self.capture)
            for (task, p), out in zip(planned, outs, strict=True):
                self.guard([task], lambda t=task, p=p, o=out: committed.append(t.commit(p, o)))

        def guarded() -> None:
            self.guard([t for t, _ in planned], forward)

        if self.thread_count is not None:
            self.thread_count.run(sum(len(p.ids) for _, p in planned), guarded)
        else:
            guarded()
        seconds = time.perf_counter() - started
        self.step_seconds += STEP_TIME_WEIGHT * (seconds - self.step_seconds)
        if len(tasks) > 1:
            self.batch_drafting.record(len(tasks), draft, sum(committed), seconds)

    def guard(self, tasks: list[Task], work: Callable[[], None]) -> bool:
        """Run work; on an exception, end `tasks` with it (the others keep running). False when it raised."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - surfaced to the callers; the worker keeps serving
            for task in tasks:
                if task.slot.task is task:
                    self._fail(task.job, task.slot, exc, task)
            return False
        return True

    def _fail(self, job: Job, slot: Slot, exc: Exception, task: Task | None = None) -> None:
        log.exception("request %s failed", job.request.request_id, exc_info=exc)
        if task is not None:
            task.stop_waiting()
        if task is not None and task.taken:
            try:  # the slot's caches back to a state the prefix cache knows
                ids = task.decoder.finish(task.consumed)
                if slot.prefix is not None:
                    slot.prefix.release(ids)
            except Exception:  # noqa: BLE001
                log.exception("slot %d could not be cleaned after a failure", slot.id)
                if slot.prefix is not None:
                    slot.prefix.acquire([], enabled=False)  # forget what it held
        self._free(slot)
        job.emit(ErrorEvent(exc))

    def _free(self, slot: Slot) -> None:
        task, slot.task = slot.task, None
        slot.last_used = time.perf_counter()
        if task is not None:  # what waited for its chunks takes what it can without them
            task.release_followers()


def _rate(n: int, ms: float) -> float:
    return n / ms * 1e3 if ms > 0 else 0.0

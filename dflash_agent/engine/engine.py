"""The engine: one worker thread owns the model and serves queued requests; callers read an async event stream."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cuda_graphs import enable_cuda_graphs
from .drafter import Drafter, load_drafter
from .errors import OptionError, RequestError
from .generation_config import read_sampling_defaults
from .kv_cache import check_kv_dtype
from .memory_plan import cpu_context_size, drafter_plan, gpu_context_size
from .model import ContextOverflowError, GemmaModel
from .packed_linear import cpu_dot
from .prefix_cache import PrefixCache, PrefixCacheConfig, PrefixCacheStats, Reuse
from .progress import PROGRESS_EVERY_S, ProgressLog
from .sampling import Sampler, StopStringFilter
from .speculative import LengthController, RequestDecoder, SpecConfig
from .tokenizer import IncrementalDetokenizer, Tokenizer
from .types import (
    SAMPLING_DEFAULTS,
    WEIGHTS,
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    GenerateResult,
    SamplingDefaults,
    Timings,
    TokenEvent,
    Usage,
)
from .weights import EMBEDDED, build_model, default_drafter, open_checkpoint, resolve_model_path

log = logging.getLogger(__name__)

DEFAULT_PREFIX_CACHE = PrefixCacheConfig()  # frozen: one shared default is safe


@dataclass
class _Job:
    request: GenerateRequest
    emit: Callable[[TokenEvent | FinalEvent | ErrorEvent], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class Engine:
    def __init__(
        self,
        model: GemmaModel,
        tokenizer: Tokenizer,
        n_ctx: int,
        model_name: str = "",
        drafter: Drafter | None = None,
        spec: SpecConfig | None = None,
        model_path: Path | None = None,
        prefix_cache: PrefixCacheConfig | None = DEFAULT_PREFIX_CACHE,
        kv_dtype: str = "auto",
        sampling_defaults: SamplingDefaults | None = None,
    ) -> None:
        self.model = model
        self.model_path = model_path  # where the checkpoint's own chat template is read from
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.model_name = model_name
        self.drafter = drafter
        self.spec = spec or SpecConfig()
        # What a request's omitted sampling fields take (SamplingDefaults.resolve).
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self.progress_every_s = PROGRESS_EVERY_S  # progress lines of a long request (engine.progress)
        self._drafter_cache = drafter.new_cache(n_ctx) if drafter is not None else None
        # Shared across requests, so what it learns about draft lengths carries over.
        self._controller: LengthController | None = None
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._cache = model.new_cache(n_ctx, kv_dtype)
        # The drafter's cache is fed (and so worth keeping) only while speculation is on.
        fed = self._drafter_cache if self.spec.enabled else None
        self._prefix = PrefixCache(prefix_cache, self._cache, fed) if prefix_cache is not None else None
        self._worker = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self._worker.start()

    @classmethod
    def load(
        cls,
        model: str = EMBEDDED,
        draft: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        ctx_size: int | None = None,
        progress: bool = True,
        spec: SpecConfig | None = None,
        draft_quant: str | None = None,
        prefix_cache: bool = True,
        kv_dtype: str = "auto",
        weights: str = "auto",
        threads: int | None = None,
        sampling_defaults: str = "model",
    ) -> Engine:
        """draft: a DFlash drafter checkpoint; None takes the model's bundled one, if it has one
        and speculation is on (spec.enabled).
        prefix_cache: reuse the KV of earlier requests (PrefixCacheConfig's defaults: stored
        conversations in up to a quarter of RAM, at most 8 GiB, and at most 16 of them).
        kv_dtype: "auto" (the model's dtype) or "q8" (8-bit keys and values).
        weights: "auto" (GGUF matrices stay packed: Triton kernels on CUDA, kernels.cpu_dot on the CPU where a C
        compiler builds it, else dequantized), "packed" (also on the CPU without a compiler, through torch's
        int4 / int8 kernels; engine.packed_linear) or "exact"
        (dequantized at load to `dtype`: bit-exact against gguf-py, what the parity tests use). Safetensors
        checkpoints always load exactly.
        threads: CPU threads (default: the physical cores).
        sampling_defaults: "model" (the checkpoint's recommended sampling fills what a request leaves out:
        engine.generation_config) or "none"."""
        check_kv_dtype(kv_dtype)  # before the weights load, which takes a while
        if weights not in WEIGHTS:
            raise OptionError(f"unknown weights mode {weights!r} ({', '.join(WEIGHTS)})")
        if sampling_defaults not in SAMPLING_DEFAULTS:
            raise OptionError(f"unknown sampling defaults {sampling_defaults!r} ({', '.join(SAMPLING_DEFAULTS)})")
        set_threads(threads)
        if draft is None and (spec is None or spec.enabled):
            bundled = default_drafter(model)
            draft = str(bundled) if bundled is not None else None
        torch_device = pick_device(device)
        torch_dtype = pick_dtype(dtype, torch_device)
        path = resolve_model_path(model)
        log.info("loading %s on %s as %s", path, torch_device, torch_dtype)
        started = time.perf_counter()
        ckpt = open_checkpoint(path)
        tokenizer = Tokenizer.from_gguf(path, gguf=ckpt.gguf) if ckpt.format == "gguf" else Tokenizer.from_dir(path)
        defaults = (read_sampling_defaults(path, ckpt.gguf.fields if ckpt.gguf is not None else None)
                    if sampling_defaults == "model" else SamplingDefaults())
        # Planned before the weights load: without ctx_size, the model's own context where memory holds it
        # (the card's free memory on CUDA, the available RAM on the CPU), else the largest that fits.
        planned_drafter = drafter_plan(resolve_model_path(draft), draft_quant) if draft is not None else None
        if torch_device.type == "cuda":
            n_ctx = gpu_context_size(ckpt.config, ckpt.tensors, torch_device, torch_dtype, ctx_size, kv_dtype,
                                     planned_drafter)
        else:
            n_ctx = cpu_context_size(ckpt.config, ckpt.tensors, torch_dtype, ctx_size, kv_dtype, planned_drafter)
        # auto on the CPU: the packed C kernels where they build (kernels.cpu_dot), else the exact weights, whose
        # float32 GEMMs prefill faster than torch's int4 / int8 kernels
        repack_cpu = weights == "packed" or (weights == "auto" and torch_device.type == "cpu" and cpu_dot() is not None)
        net = build_model(ckpt, torch_device, torch_dtype, progress=progress,
                          packed=False if weights == "exact" else None, repack_cpu=repack_cpu)
        enable_cuda_graphs(net)  # decode / verify steps replay CUDA graphs (a no-op off CUDA)
        drafter = None
        if draft is not None:
            cfg = ckpt.config
            drafter = load_drafter(
                resolve_model_path(draft), cfg.hidden_size, cfg.num_layers, cfg.vocab_size,
                torch_device, torch_dtype, quantize=draft_quant,
            )
        log.info("loaded in %.1f s; context %d tokens", time.perf_counter() - started, n_ctx)
        name = Path(path).name if model == EMBEDDED else model
        return cls(net, tokenizer, n_ctx, model_name=name, drafter=drafter, spec=spec, model_path=path,
                   prefix_cache=DEFAULT_PREFIX_CACHE if prefix_cache else None, kv_dtype=kv_dtype,
                   sampling_defaults=defaults)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Queue the request and yield its events; raises ContextOverflowError / RequestError for bad requests.
        Prefer `complete` or `stream`, which cancel the request when their consumer stops."""
        self._validate(request)
        if not request.request_id:
            request.request_id = f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event: TokenEvent | FinalEvent | ErrorEvent) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the consumer's loop has closed (it left early): nobody is left to read
                pass

        job = _Job(request, emit)
        with self._lock:
            if request.request_id in self._jobs:
                raise RequestError(f"request id {request.request_id!r} is already running")
            self._jobs[request.request_id] = job
        self._queue.put(job)
        try:
            while True:
                event = await events.get()
                if isinstance(event, ErrorEvent):
                    raise event.error
                yield event
                if isinstance(event, FinalEvent):
                    return
        finally:
            # A consumer that stops reading (client disconnect) cancels its generation.
            job.cancelled.set()

    @asynccontextmanager
    async def stream(self, request: GenerateRequest) -> AsyncIterator[AsyncIterator[TokenEvent | FinalEvent]]:
        """`generate` for a consumer that reads events as they come: however the block is left (the final event
        read, an early break, an exception, a cancelled task), the generation ends then and frees the engine.

        ```python
        async with engine.stream(request) as events:
            async for event in events: ...
        ```"""
        events = self.generate(request)
        try:
            yield events
        finally:
            # A generator left suspended is only closed when collected; closing it now cancels the job.
            await events.aclose()

    async def complete(self, request: GenerateRequest,
                       on_token: Callable[[TokenEvent], None] | None = None) -> GenerateResult:
        """The whole generation (text, ids, final event); `on_token` sees each token event as it arrives.
        Cancelled with its task, like `stream`."""
        parts: list[str] = []
        ids: list[int] = []
        async with self.stream(request) as events:
            async for event in events:
                if isinstance(event, FinalEvent):
                    return GenerateResult("".join(parts), ids, event)
                parts.append(event.text_delta)
                ids.extend(event.ids)
                if on_token is not None:
                    on_token(event)
        raise RuntimeError("the engine ended a stream without a final event")

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            job = self._jobs.get(request_id)
        if job is None:
            return False
        job.cancelled.set()
        return True

    @property
    def prefix_stats(self) -> PrefixCacheStats | None:
        """Hit counts and memory of the prefix cache; None when it is off."""
        return self._prefix.stats if self._prefix is not None else None

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=10)

    def _validate(self, request: GenerateRequest) -> None:
        if not request.prompt_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of range (vocabulary of {vocab})")
        if len(request.prompt_ids) >= self.n_ctx:
            raise ContextOverflowError(len(request.prompt_ids) + 1, self.n_ctx)
        if request.max_tokens is not None and request.max_tokens < 0:
            raise RequestError(f"max_tokens must be >= 0, got {request.max_tokens}")

    @torch.inference_mode()
    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if not job.cancelled.is_set():
                    self._decode(job)
                else:
                    job.emit(FinalEvent("cancelled", Usage(len(job.request.prompt_ids), 0), Timings()))
            except Exception as exc:  # surfaced to the caller; the worker keeps serving
                log.exception("request %s failed", job.request.request_id)
                job.emit(ErrorEvent(exc))
            finally:
                with self._lock:
                    self._jobs.pop(job.request.request_id, None)

    def _decode(self, job: _Job) -> None:
        req, model = job.request, self.model
        decoder = RequestDecoder(
            model, self._cache, Sampler(req.sampling, model.device, model.argmax),
            drafter=self.drafter, drafter_cache=self._drafter_cache,
            matcher=req.grammar.matcher() if req.grammar is not None else None,
            spec=self.spec, controller=self._controller,
        )
        self._controller = decoder.shared_controller
        stop_ids = self.tokenizer.stop_ids | req.stop.token_ids
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopStringFilter(req.stop.strings)
        budget = self.n_ctx - len(req.prompt_ids)
        max_tokens = budget if req.max_tokens is None else min(req.max_tokens, budget)
        prefix = self._prefix

        started = time.perf_counter()
        reuse = prefix.acquire(req.prompt_ids, req.cache_prompt) if prefix is not None else Reuse()
        if req.on_prefix is not None:
            req.on_prefix(reuse.tokens)
        progress = ProgressLog(req.request_id, self.progress_every_s)

        def on_chunk(position: int, logits: torch.Tensor | None) -> None:
            if prefix is not None:
                prefix.prefilled(position, logits)
            progress.prefilled(position - reuse.tokens, len(req.prompt_ids) - reuse.tokens)

        prefilled = decoder.prefill(req.prompt_ids, reuse.tokens, reuse.logits, on_chunk=on_chunk,
                                    stop=job.cancelled.is_set)
        timings = Timings(cache_n=reuse.tokens, prompt_n=len(req.prompt_ids) - reuse.tokens)
        timings.prompt_ms = (time.perf_counter() - started) * 1e3

        decode_started = time.perf_counter()
        progress.decoding()
        generated: list[int] = []
        finish, matched = ("length" if prefilled else "cancelled"), None
        for token in decoder.tokens(max_tokens if prefilled else 0):
            if job.cancelled.is_set():
                finish = "cancelled"
                break
            if token in stop_ids:
                finish, matched = "stop", token
                break
            generated.append(token)
            progress.generated(len(generated), max_tokens)
            text, matched = stops.push(detok.push([token]))
            job.emit(TokenEvent([token], text))
            if matched is not None:
                finish = "stop"
                break
        if not isinstance(matched, str):
            # Bytes the detokenizer held back, then whatever the stop filter held back.
            text, hit = stops.push(detok.flush())
            tail = text if hit else text + stops.flush()
            if hit:
                finish, matched = "stop", hit
            if tail:
                job.emit(TokenEvent([], tail))
        cached_ids = decoder.finish()
        if prefix is not None:
            prefix.release(cached_ids)
        timings.predicted_n = len(generated)
        timings.predicted_ms = (time.perf_counter() - decode_started) * 1e3
        timings.prompt_per_second = _rate(timings.prompt_n, timings.prompt_ms)
        timings.predicted_per_second = _rate(timings.predicted_n, timings.predicted_ms)
        timings.draft_n, timings.draft_n_accepted = decoder.stats.drafted, decoder.stats.accepted
        usage = Usage(len(req.prompt_ids), len(generated), cached_tokens=reuse.tokens)
        context_full = finish == "length" and (req.max_tokens is None or req.max_tokens > budget)
        job.emit(FinalEvent(finish, usage, timings, matched, decoder.stats, context_full))


def physical_cores() -> int:
    """Cores this process may run on, not hardware threads: a second thread on a core only competes for its
    vector units. Linux's /proc/cpuinfo names each CPU's core; elsewhere, every CPU counts."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        cores, cpu = set(), None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "processor":
                cpu, package = int(value), "0"
            elif key == "physical id":
                package = value
            elif key == "core id" and cpu in cpus:
                cores.add((package, value))
        return len(cores) or len(cpus)
    except (OSError, ValueError):
        return len(cpus) or 1


def set_threads(threads: int | None) -> None:
    if threads is not None and threads < 1:
        raise OptionError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads or physical_cores())


def _rate(n: int, ms: float) -> float:
    return n / ms * 1e3 if ms > 0 else 0.0


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise OptionError("--device cuda was asked for but no CUDA GPU is available")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise OptionError(f"unknown device {device!r} (auto, cpu, cuda)")
    return torch.device(device)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # CPUs without native bf16 run float32 faster; GPUs want bf16.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise OptionError(f"unknown dtype {dtype!r} (auto, {', '.join(_DTYPES)})")
    return _DTYPES[dtype]

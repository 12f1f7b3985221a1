"""The engine: one worker thread owns the model and serves queued requests; callers read an async event stream."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import torch

from .cache.prefix_cache import PrefixCacheConfig, PrefixCacheStats
from .engine_config import EMBEDDED, EngineConfig, SpecConfig
from .errors import OptionError, RequestError
from .load.generation_config import read_sampling_defaults
from .load.tokenizer import Tokenizer
from .load.weights import build_model, default_drafter, open_checkpoint, resolve_model_path
from .memory_plan import cpu_context_size, cpu_weights, drafter_plan, gpu_context_size
from .model.drafter import Drafter, load_drafter
from .model.gemma import ContextOverflowError, GemmaModel
from .model.mtp import MtpDrafter, is_mtp_checkpoint, load_mtp_drafter
from .model.packed import choose_cuda_tiles, cpu_dot, prefill_dtype, release_cpu_threads
from .progress import PROGRESS_EVERY_S
from .runner import StepRunner
from .scheduler import Job, Scheduler
from .types import (
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    GenerateResult,
    SamplingDefaults,
    SlotInfo,
    TokenEvent,
)

log = logging.getLogger(__name__)

AUTO_PARALLEL = 4  # slots on the CPU when not told (llama-server's default)
DEFAULT_PREFIX_CACHE = PrefixCacheConfig()  # frozen: one shared default is safe


class Engine:
    def __init__(
        self,
        model: GemmaModel,
        tokenizer: Tokenizer,
        n_ctx: int,
        model_name: str = "",
        drafter: Drafter | MtpDrafter | None = None,
        spec: SpecConfig | None = None,
        model_path: Path | None = None,
        prefix_cache: PrefixCacheConfig | None = DEFAULT_PREFIX_CACHE,
        kv_dtype: str = "model",
        sampling_defaults: SamplingDefaults | None = None,
        parallel: int = 1,
        runner: StepRunner | None = None,
    ) -> None:
        """runner: the model's step runner (StepRunner.build's, with every backend the model qualifies for, when
        not given)."""
        if parallel < 1:
            raise OptionError(f"parallel must be >= 1 slot, got {parallel}")
        if runner is not None and runner.model is not model:
            raise ValueError("the runner given runs another model")
        self.model = model
        self.runner = runner if runner is not None else StepRunner.build(model, parallel)
        self.model_path = model_path  # where the checkpoint's own chat template is read from
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.model_name = model_name
        self.drafter = drafter
        self.spec = spec or SpecConfig()
        # What a request's omitted sampling fields take (SamplingDefaults.resolve).
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self.parallel = parallel
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._scheduler = Scheduler(self.runner, tokenizer, n_ctx, parallel, kv_dtype, drafter, self.spec, prefix_cache,
                                    PROGRESS_EVERY_S)
        self._worker = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        release_cpu_threads(model.device)  # the worker runs the kernels from here on (kernels.cpu.cpu_dot)
        self._worker.start()

    @property
    def progress_every_s(self) -> float:
        """How often a long request logs a progress line (engine.progress)."""
        return self._scheduler.progress_every_s

    @progress_every_s.setter
    def progress_every_s(self, seconds: float) -> None:
        self._scheduler.progress_every_s = seconds

    @classmethod
    def load(cls, *args, **options) -> Engine:
        """`from_config(EngineConfig(...))`: the options, positional in EngineConfig's order or by name, as
        EngineConfig documents them; an unknown one is a TypeError."""
        return cls.from_config(EngineConfig(*args, **options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Load the model (and its drafter) `config` names and start the engine's worker; `config` was checked
        when built, before any weight loads."""
        set_threads(config.threads)
        draft, weights, parallel = config.draft, config.weights, config.parallel  # "auto" / None resolved below
        if draft is None and (config.spec is None or config.spec.enabled):
            bundled = default_drafter(config.model)
            draft = str(bundled) if bundled is not None else None
        torch_device = pick_device(config.device)
        torch_dtype = pick_dtype(config.dtype, torch_device)
        if parallel is None:
            parallel = AUTO_PARALLEL if torch_device.type == "cpu" else 1
        path = resolve_model_path(config.model)
        log.info("loading %s on %s as %s", path, torch_device, torch_dtype)
        started = time.perf_counter()
        ckpt = open_checkpoint(path)
        tokenizer = Tokenizer.from_gguf(path, gguf=ckpt.gguf) if ckpt.format == "gguf" else Tokenizer.from_dir(path)
        defaults = (read_sampling_defaults(path, ckpt.gguf.fields if ckpt.gguf is not None else None)
                    if config.sampling_defaults == "model" else SamplingDefaults())
        # Planned before the weights load: without ctx_size, the model's own context where memory holds it
        # (the card's free memory on CUDA, the available RAM on the CPU), else the largest that fits.
        draft_path = resolve_model_path(draft) if draft is not None else None
        # a Gemma 4 assistant is a few small layers with no cache of its own: nothing to plan beside the target
        mtp = draft_path is not None and is_mtp_checkpoint(draft_path)
        if draft_path is None and config.draft_ctx is not None:
            log.warning("--draft-ctx is ignored: there is no drafter (the model has no bundled one; --draft names one)")
        if mtp and config.draft_ctx is not None:
            raise OptionError("--draft-ctx bounds a DFlash drafter's context; a Gemma 4 assistant (MTP) drafter "
                              "reads the target's own cache")
        planned_drafter = (drafter_plan(draft_path, config.draft_quant, config.draft_ctx)
                           if draft_path is not None and not mtp else None)
        if torch_device.type == "cuda":
            n_ctx, kv_dtype = gpu_context_size(ckpt.config, ckpt.tensors, torch_device, torch_dtype, config.ctx_size,
                                               config.kv_dtype, planned_drafter, slots=parallel)
        else:
            if weights == "auto":  # the C kernels where a vector build runs, else by what fits in RAM
                weights = cpu_weights(ckpt.tensors, torch_dtype, cpu_dot() is not None)
            # the model's dtype: the C layers read only float32 caches, and an 8-bit one would leave them
            kv_dtype = "model" if config.kv_dtype == "auto" else config.kv_dtype
            n_ctx = cpu_context_size(ckpt.config, ckpt.tensors, torch_dtype, config.ctx_size, kv_dtype,
                                     planned_drafter, slots=parallel, packed=weights == "packed")
        repack_cpu = weights == "packed"
        prefill_gemm = prefill_dtype(config.prefill)
        if repack_cpu and cpu_dot() is not None:
            log.info("prompt blocks: %s GEMMs%s", str(prefill_gemm).removeprefix("torch."),
                     " (--prefill float32: exact)" if prefill_gemm != torch.float32 else "")
        net = build_model(ckpt, torch_device, torch_dtype, progress=config.progress,
                          packed=False if weights == "exact" else None, repack_cpu=repack_cpu, prefill=prefill_gemm)
        if torch_device.type == "cuda":
            choose_cuda_tiles(net.matmul_weights())  # before the graphs capture the launches
        runner = StepRunner.build(net, parallel)  # the C layers, CUDA graphs: whichever this model takes
        drafter: Drafter | MtpDrafter | None = None
        if draft_path is not None and mtp:
            drafter = load_mtp_drafter(draft_path, ckpt.config, torch_device, torch_dtype)
        elif draft_path is not None:
            cfg = ckpt.config
            drafter = load_drafter(
                draft_path, cfg.hidden_size, cfg.num_layers, cfg.vocab_size,
                torch_device, torch_dtype, quantize=config.draft_quant,
            )
            if config.draft_ctx is not None:
                drafter = drafter.with_context_window(config.draft_ctx)
                log.info("the drafter reads the last %d tokens of the context", config.draft_ctx)
        log.info("loaded in %.1f s; context %d tokens%s", time.perf_counter() - started, n_ctx,
                 f" x {parallel} slots" if parallel > 1 else "")
        name = Path(path).name if config.model == EMBEDDED else config.model
        return cls(net, tokenizer, n_ctx, model_name=name, drafter=drafter, spec=config.spec, model_path=path,
                   prefix_cache=DEFAULT_PREFIX_CACHE if config.prefix_cache else None, kv_dtype=kv_dtype,
                   sampling_defaults=defaults, parallel=parallel, runner=runner)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Queue the request and yield its events; raises ContextOverflowError / RequestError for bad requests.
        Prefer `complete` or `stream`, which cancel the request when their consumer stops."""
        self._validate(request)
        if not request.request_id:
            request.request_id = f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event: TokenEvent | FinalEvent | ErrorEvent) -> None:
            if isinstance(event, FinalEvent | ErrorEvent):  # the request id is free again
                with self._lock:
                    if self._jobs.get(request.request_id) is job:
                        del self._jobs[request.request_id]
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the consumer's loop has closed (it left early): nobody is left to read
                pass

        job = Job(request, emit)
        with self._lock:
            if request.request_id in self._jobs:
                raise RequestError(f"request id {request.request_id!r} is already running")
            self._jobs[request.request_id] = job
        self._scheduler.submit(job)
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
        return self._scheduler.prefix_stats

    @property
    def slots(self) -> list[SlotInfo]:
        """What each slot does now (a snapshot; prompt ids included, for callers that choose to show them)."""
        return self._scheduler.slot_info()

    @property
    def queued(self) -> int:
        """Requests waiting for a free slot."""
        return self._scheduler.queued

    def close(self, timeout: float | None = None) -> bool:
        """Stop the worker; requests still running or waiting end as cancelled. The step in flight ends first (a
        prompt chunk on a slow CPU: seconds): waits for it up to `timeout` seconds (None: however long it takes),
        and says whether the worker has stopped. Until it has, the process must not end normally: finalizing torch
        under a running step aborts it (SIGABRT). Calling it again waits again."""
        self._scheduler.submit(None)
        self._worker.join(timeout)
        return not self._worker.is_alive()

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

    def _run(self) -> None:
        self._scheduler.run()


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

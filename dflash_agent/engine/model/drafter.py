"""The DFlash block-diffusion drafter (z-lab's checkpoint format) over the target's features.

The drafter has no embedding or LM head of its own: it reads the target's. Each committed token's
target features (the outputs of `target_layer_ids`) are projected once into per-layer context K/V
and kept in a `DrafterCache`; a draft then runs only the block tokens ([anchor, mask, mask, ...])
as queries over that cache. Sliding layers are causal inside the block, full layers bidirectional,
as z-lab's reference (`dflash.model`) does.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from ...kernels.attention import cache_attention, grouped_attention
from ..cache.drafter_cache import DrafterCache
from ..errors import DrafterError
from ..formats.drafter_config import DrafterConfig, build_target_layer_ids
from .gemma import RMSNorm, rope_tables
from .quant_linear import quantize_linear_weights

log = logging.getLogger(__name__)


def _linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


@dataclass(frozen=True)
class DraftLayerPlan:
    """How one drafter layer's block queries attend during one forward.

    mode "concat" (eager drafts, training): SDPA over the layer's context keys followed by the block's own,
    with `mask` (None: every key visible). mode "cache" (CUDA graphs): the block's keys are written into the
    layer's drafter cache at `slots` (just past the context) and kernels.attention reads the whole cache,
    the key of slot j (at position key_positions[j], or j where None) visible to query i iff at or before
    query_positions[i] and within `window`.
    """

    mode: Literal["concat", "cache"]
    keys: torch.Tensor  # [C, kv_heads, head_dim]; concat: the context's keys; cache: the layer's whole cache
    values: torch.Tensor
    mask: torch.Tensor | None = None  # concat: [T, C + T] bool, True = visible
    slots: torch.Tensor | None = None  # cache: [T] the slots the block's keys are written to
    query_positions: torch.Tensor | None = None  # cache: [T] the position each query masks slots by
    window: int | None = None  # cache: sliding window (concat layers put theirs in the mask)
    key_positions: torch.Tensor | None = None  # cache: a ring's slot -> position map; None: slot = position

    def __post_init__(self) -> None:
        if self.mode == "cache" and (self.slots is None or self.query_positions is None):
            raise ValueError("a 'cache' draft layer plan needs slots and query positions")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the block's queries q [T, heads, d], its keys and values k / v [T, kv_heads, d]."""
        if self.mode == "cache":
            assert self.slots is not None and self.query_positions is not None
            self.keys.index_copy_(0, self.slots, k)
            self.values.index_copy_(0, self.slots, v)
            return cache_attention(q, self.keys, self.values, self.query_positions, self.key_positions, self.window,
                                   scale)
        keys, values = torch.cat((self.keys, k)), torch.cat((self.values, v))
        return grouped_attention(q, keys, values, self.mask, scale)


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.head_dim = config.num_heads, d
        self.q_proj = _linear(h, config.num_heads * d)
        self.k_proj = _linear(h, config.num_kv_heads * d)
        self.v_proj = _linear(h, config.num_kv_heads * d)
        self.o_proj = _linear(config.num_heads * d, h)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, offset=0.0)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, offset=0.0)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = ctx.shape[0]
        k = self.k_norm(self.k_proj(ctx).view(T, -1, self.head_dim), cos, sin)
        return k, self.v_proj(ctx).view(T, -1, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: DraftLayerPlan) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).view(T, self.num_heads, d), cos, sin)
        k, v = self.context_kv(x, cos, sin)
        return self.o_proj(plan.attend(q, k, v, d**-0.5).reshape(T, self.num_heads * d))


class DrafterMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, intermediate)
        self.up_proj = _linear(hidden, intermediate)
        self.down_proj = _linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset=0.0)
        self.self_attn = DrafterAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset=0.0)
        self.mlp = DrafterMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: DraftLayerPlan) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """DFlash drafter weights plus the two operations the decode loop needs:
    `append_context` (features of newly committed tokens -> cached K/V) and `draft` (one block)."""

    def __init__(self, config: DrafterConfig, target_hidden: int) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.fc = _linear(len(config.target_layer_ids) * target_hidden, config.hidden_size)
            self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=0.0)
            self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=0.0)
        d = config.head_dim
        self.register_buffer(
            "inv_freq", 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d), persistent=False
        )

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs it drafts from."""
        return tuple(self.config.target_layer_ids)

    def with_context_window(self, tokens: int) -> Drafter:
        """This drafter (the same weights) reading at most the last `tokens` of the context in every layer
        (DrafterConfig.with_context_window): its cache stops growing with the context."""
        bounded = copy.copy(self)  # a module's shallow copy shares its parameters and buffers
        bounded.config = self.config.with_context_window(tokens)
        return bounded

    def new_cache(self, max_len: int) -> DrafterCache:
        return DrafterCache(self.config, max_len, self.device, self.dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [T, head_dim] at positions [T]."""
        return rope_tables(self.inv_freq, positions, self.dtype)

    @torch.inference_mode()
    def append_context(self, features: torch.Tensor, cache: DrafterCache) -> None:
        """Project the target features of C newly committed tokens ([C, n_target_layers * H]) into
        every layer's context K/V at positions cache.length.."""
        C, start = features.shape[0], cache.length
        if start + C > cache.max_len:
            raise ValueError(f"the drafter cache holds {cache.max_len} tokens, {start + C} asked for")
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = self.rope(torch.arange(start, start + C, device=self.device))
        for i, layer in enumerate(self.layers):
            cache.write(i, start, *layer.self_attn.context_kv(ctx, cos, sin))
        cache.advance(start, start + C)
        cache.length = start + C

    @torch.inference_mode()
    def draft(self, block_embeds: torch.Tensor, cache: DrafterCache) -> torch.Tensor:
        """Hidden states [T, H] for a block at positions cache.length..; the cache is read, not written."""
        T, start = block_embeds.shape[0], cache.length
        pos = torch.arange(start, start + T, device=self.device)
        plans = []
        for i in range(self.config.num_layers):
            ring = cache.key_positions(i)
            if ring is None:  # slot = position
                keys, values, held = cache.k[i][:start], cache.v[i][:start], torch.arange(start, device=self.device)
            else:  # a ring's slots, the empty ones and those past the context (a rolled-back tail) masked out
                keys, values, held = cache.k[i], cache.v[i], torch.where(ring < start, ring, -1)
            k_pos = torch.cat((held, pos))[None, :]
            plans.append(DraftLayerPlan("concat", keys, values, self._mask(i, pos[:, None], k_pos)))
        return self.layers_forward(block_embeds.to(self.dtype), self.rope(pos), plans)

    def layers_forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], plans: list[DraftLayerPlan]
    ) -> torch.Tensor:
        """The drafter layers and final norm over block embeddings x [T, H] with RoPE tables (cos, sin) at
        the block's positions: the one forward that eager drafts, the CUDA-graph draft (engine.backends.cuda)
        and training (train.blocks) run."""
        for layer, plan in zip(self.layers, plans, strict=True):
            x = layer(x, *rope, plan)
        return self.norm(x)

    def _mask(self, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """[T, keys] True where a key at k_pos [1, keys] (-1: an empty slot) is visible to a query at q_pos [T, 1]."""
        causal, window = self.config.causal[layer], self.config.window[layer]
        if not causal and window is None:
            return None
        visible = (k_pos >= 0).expand(q_pos.shape[0], -1).clone()
        if causal:
            visible &= k_pos <= q_pos
        if window is not None:  # a bidirectional layer's counts back from the block's last position
            visible &= (q_pos if causal else q_pos[-1:]) - k_pos < window
        return visible

    def logits(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Draft logits through the target's LM head (float32), as the reference's compute_logits."""
        logits = F.linear(hidden.to(head_weight.dtype), head_weight).float() * self.config.output_multiplier
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits


def load_drafter(
    path: str | Path,
    target_hidden: int,
    target_layers: int,
    target_vocab: int,
    device: torch.device,
    dtype: torch.dtype,
    quantize: str | None = None,
) -> Drafter:
    """Load a z-lab DFlash checkpoint directory (config.json + model.safetensors) for a target with
    `target_hidden` width, `target_layers` decoder layers and `target_vocab` tokens."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise DrafterError(f"{path} has no config.json (expected a z-lab DFlash drafter directory)")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise DrafterError(f"{config_path}: invalid JSON ({exc})") from None
    config = DrafterConfig.from_dict(raw, str(config_path))
    bad_layers = [i for i in config.target_layer_ids if not 0 <= i < target_layers]
    if bad_layers:
        raise DrafterError(f"the drafter reads target layer {bad_layers[0]} but the target has {target_layers} layers")
    if config.hidden_size != target_hidden:
        # The block enters as the target's embeddings and leaves through its LM head.
        raise DrafterError(f"the drafter's hidden size is {config.hidden_size} but the target's is {target_hidden}")
    if not 0 <= config.mask_token_id < target_vocab:
        raise DrafterError(f"mask_token_id {config.mask_token_id} is outside the target vocabulary ({target_vocab})")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterError(f"{path} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    state = {name.removeprefix("model."): t for name, t in state.items()}
    drafter = Drafter(config, target_hidden)
    expected = {name: p.shape for name, p in drafter.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DrafterError(f"{path}: the checkpoint lacks {missing[0]}{more}")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise DrafterError(f"{path}: {name} has shape {tuple(state[name].shape)}, expected {tuple(shape)}")
    unused = sorted(set(state) - set(expected) - {"embed_tokens.weight", "lm_head.weight"})
    if unused:
        log.warning("drafter %s: ignoring %d unknown tensors (%s...)", path, len(unused), unused[0])
    weights = {name: state[name].to(device=device, dtype=dtype) for name in expected}
    drafter.load_state_dict(weights, assign=True)
    drafter.inv_freq = drafter.inv_freq.to(device)
    if quantize is not None:
        quantize_linear_weights(drafter, quantize)
    n_params = sum(t.numel() for t in weights.values())
    log.info(
        "drafter %s: %d layers, block %d, %.1fM parameters%s",
        path.name, config.num_layers, config.block_size, n_params / 1e6, f", {quantize}" if quantize else "",
    )
    return drafter.eval()


def init_drafter_checkpoint(
    path: str | Path,
    target_hidden: int,
    target_layers: int,
    mask_token_id: int,
    num_layers: int = 3,
    block_size: int = 16,
    sliding_window: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a randomly initialized drafter for a target in z-lab's format (config.json +
    model.safetensors): the starting point for training, and a stand-in for benchmarks."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    heads = max(1, target_hidden // 128)
    head_dim = target_hidden // heads
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target_hidden,
        "intermediate_size": 2 * target_hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2 if heads % 2 == 0 else 1,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": True,
        "layer_types": ["sliding_attention"] * (num_layers - 1) + ["full_attention"],
        "sliding_window": sliding_window,
        "use_sliding_window": True,
        "block_size": block_size,
        "num_target_layers": target_layers,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": build_target_layer_ids(target_layers, num_layers),
        },
    }
    config = DrafterConfig.from_dict(raw)
    drafter = Drafter(config, target_hidden)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, p in drafter.state_dict().items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(p.shape)
        else:
            weights[name] = torch.randn(p.shape, generator=generator) * 0.02
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return path

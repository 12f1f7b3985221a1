"""One model description for Gemma 3 and Gemma 4 text decoders, from a HF config.json or GGUF metadata."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import ConfigError

Family = Literal["gemma3", "gemma4"]


@dataclass(frozen=True)
class LayerSpec:
    sliding: bool
    head_dim: int
    num_kv_heads: int
    rope_theta: float
    # Rotated frequency pairs; the remaining head_dim/2 - rope_angles pairs pass through (Gemma 4 "proportional").
    rope_angles: int
    # Linear RoPE scaling divides every frequency (Gemma 3 4B+ global layers).
    rope_factor: float = 1.0
    # V is the (v-normed) raw K projection: Gemma 4 full layers have no v_proj.
    k_eq_v: bool = False
    # Gemma 4 E2B / E4B: the layer has no K / V of its own and attends over those of layer `kv_source` (the last
    # earlier layer of its kind that has them), as that layer attended in the same step.
    kv_source: int | None = None
    # The MLP width where it differs from the model's (E2B / E4B double the KV-sharing layers'); 0: the model's.
    intermediate_size: int = 0

    def inv_freq(self) -> list[float]:
        """RoPE inverse frequencies; exponents use the full head_dim even when only some pairs rotate."""
        rotated = [1.0 / self.rope_theta ** (2 * i / self.head_dim) for i in range(self.rope_angles)]
        zeros = [0.0] * (self.head_dim // 2 - self.rope_angles)
        return [f / self.rope_factor for f in rotated + zeros]


@dataclass(frozen=True)
class MoESpec:
    """Gemma 4 26B-A4B: every layer adds routed experts beside its dense MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's


@dataclass(frozen=True)
class ModelConfig:
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layers: tuple[LayerSpec, ...]
    sliding_window: int
    rms_norm_eps: float
    # RMSNorm multiplies by (norm_offset + w): 1.0 in HF Gemma 3 checkpoints, 0.0 in Gemma 4 and in every GGUF
    # (llama.cpp's converter folds the +1 into Gemma 3's stored weights).
    norm_offset: float
    attn_scale: float
    final_softcap: float | None
    # Gemma 4 normalizes V with a weightless RMSNorm.
    v_norm: bool
    # Gemma 4 multiplies the residual stream by a per-layer scalar loaded from the checkpoint.
    layer_scalar: bool
    tie_embeddings: bool
    max_position_embeddings: int
    moe: MoESpec | None = None
    # Gemma 4 E2B / E4B per-layer embeddings (PLE): each layer adds a gated [per_layer_input]-wide input made from a
    # [vocab, layers x per_layer_input] table and a projection of the token's embedding; 0: none.
    per_layer_input: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_intermediate_size(self, index: int) -> int:
        return self.layers[index].intermediate_size or self.intermediate_size

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        try:
            raw = json.loads(config_path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{config_path} not found") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{config_path} is not valid JSON: {exc}") from None
        return cls.from_hf_dict(raw, source=str(config_path))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type in ("gemma3", "gemma4"):
            if "text_config" not in raw:
                raise ConfigError(f"{source}: model_type {model_type!r} needs a 'text_config'")
            text = dict(raw["text_config"])
            text.setdefault("model_type", f"{model_type}_text")
            # Multimodal configs keep the tie flag at the top level.
            text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", True))
            return cls.from_hf_dict(text, source=f"{source} text_config")
        if model_type == "gemma3_text":
            return _gemma3_from_hf(_Keys(raw, source))
        if model_type == "gemma4_text":
            return _gemma4_from_hf(_Keys(raw, source))
        raise ConfigError(
            f"{source}: unsupported model_type {model_type!r} (supported: gemma3, gemma3_text, gemma4, gemma4_text)"
        )

    @classmethod
    def from_gguf_fields(
        cls, fields: dict[str, Any], tensor_names: set[str], rope_freqs: list[float] | None = None, source: str = "GGUF"
    ) -> ModelConfig:
        """`fields` maps GGUF metadata keys to plain Python values; `rope_freqs` is Gemma 4's rope_freqs tensor."""
        arch = fields.get("general.architecture")
        if arch == "gemma3":
            return _gemma3_from_gguf(_Keys(fields, source, prefix="gemma3."))
        if arch == "gemma4":
            return _gemma4_from_gguf(_Keys(fields, source, prefix="gemma4."), tensor_names, rope_freqs)
        raise ConfigError(f"{source}: unsupported GGUF architecture {arch!r} (supported: gemma3, gemma4)")


class _Keys:
    """Reads required and optional keys with errors that name the missing key and the file."""

    def __init__(self, raw: dict[str, Any], source: str, prefix: str = "") -> None:
        self.raw, self.source, self.prefix = raw, source, prefix

    def req(self, key: str) -> Any:
        full = self.prefix + key
        if self.raw.get(full) is None:
            raise ConfigError(f"{self.source}: missing required key {full!r}")
        return self.raw[full]

    def opt(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(self.prefix + key)
        return default if value is None else value


def _layer_types(k: _Keys, num_layers: int) -> list[bool]:
    """Per-layer `sliding` flags; without `layer_types`, HF's default pattern puts a full layer every Nth."""
    types = k.opt("layer_types")
    if types is None:
        pattern = int(k.opt("sliding_window_pattern", 6))
        return [(i + 1) % pattern != 0 for i in range(num_layers)]
    if len(types) != num_layers:
        raise ConfigError(f"{k.source}: layer_types has {len(types)} entries for {num_layers} layers")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ConfigError(f"{k.source}: unsupported layer type(s) {sorted(unknown)}")
    return [t == "sliding_attention" for t in types]


def _rope_from_hf(k: _Keys, layer_type: str, head_dim: int, default_theta: float) -> tuple[float, int, float]:
    """(theta, rotated angle pairs, linear factor) for one layer type, new (`rope_parameters`) or old format."""
    params = k.opt("rope_parameters")
    if params is not None and layer_type in params:
        params = params[layer_type] or {}
    elif params is None or "rope_type" not in params:
        # Old Gemma 3 format: rope_theta / rope_local_base_freq, rope_scaling on global layers only.
        theta_key = "rope_local_base_freq" if layer_type == "sliding_attention" else "rope_theta"
        params = {"rope_theta": k.opt(theta_key, default_theta)}
        scaling = k.opt("rope_scaling")
        if scaling and layer_type == "full_attention":
            params |= scaling
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", default_theta))
    factor = float(params.get("factor", 1.0))
    if rope_type == "default":
        return theta, head_dim // 2, 1.0
    if rope_type == "linear":
        return theta, head_dim // 2, factor
    if rope_type == "proportional":
        return theta, int(params.get("partial_rotary_factor", 1.0) * head_dim // 2), factor
    raise ConfigError(f"{k.source}: unsupported rope_type {rope_type!r} for {layer_type}")


def _hf_shared(k: _Keys) -> dict[str, Any]:
    """The config.json keys Gemma 3 and Gemma 4 spell the same way."""
    return dict(
        vocab_size=int(k.req("vocab_size")),
        hidden_size=int(k.req("hidden_size")),
        intermediate_size=int(k.req("intermediate_size")),
        num_heads=int(k.req("num_attention_heads")),
        sliding_window=int(k.req("sliding_window")),
        rms_norm_eps=float(k.req("rms_norm_eps")),
        tie_embeddings=bool(k.opt("tie_word_embeddings", True)),
        max_position_embeddings=int(k.opt("max_position_embeddings", 131_072)),
    )


def _gemma3_from_hf(k: _Keys) -> ModelConfig:
    if k.opt("attn_logit_softcapping") is not None:
        raise ConfigError(f"{k.source}: attn_logit_softcapping is not supported (no Gemma 3 checkpoint uses it)")
    num_layers = int(k.req("num_hidden_layers"))
    head_dim = int(k.req("head_dim"))
    num_kv = int(k.req("num_key_value_heads"))
    specs = []
    for sliding in _layer_types(k, num_layers):
        layer_type = "sliding_attention" if sliding else "full_attention"
        theta, angles, factor = _rope_from_hf(k, layer_type, head_dim, 10_000.0 if sliding else 1_000_000.0)
        specs.append(LayerSpec(sliding, head_dim, num_kv, theta, angles, factor))
    return ModelConfig(
        family="gemma3",
        layers=tuple(specs),
        norm_offset=1.0,
        attn_scale=float(k.opt("query_pre_attn_scalar", head_dim)) ** -0.5,
        final_softcap=k.opt("final_logit_softcapping"),
        v_norm=False,
        layer_scalar=False,
        **_hf_shared(k),
    )


def _gemma4_from_hf(k: _Keys) -> ModelConfig:
    if k.opt("use_bidirectional_attention") == "all":
        raise ConfigError(f"{k.source}: use_bidirectional_attention='all' is not a causal decoder")
    num_layers = int(k.req("num_hidden_layers"))
    head_dim = int(k.req("head_dim"))
    num_kv = int(k.req("num_key_value_heads"))
    k_eq_v = bool(k.opt("attention_k_eq_v", False))
    global_head_dim = int(k.opt("global_head_dim", 512))
    # HF only applies the global KV-head override together with k_eq_v.
    global_kv = int(k.opt("num_global_key_value_heads", num_kv)) if k_eq_v else num_kv
    sliding_flags = _layer_types(k, num_layers)
    sliding_flags[-1] = False  # HF forces the last layer to full attention
    default_rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }
    if k.opt("rope_parameters") is None:
        k = _Keys(k.raw | {"rope_parameters": default_rope}, k.source)
    # Newer transformers save the full-layer overrides as `per_layer_config` (by layer index) instead.
    overrides = k.opt("per_layer_config", {})
    specs = []
    for i, sliding in enumerate(sliding_flags):
        layer_type = "sliding_attention" if sliding else "full_attention"
        dim, kv = (head_dim, num_kv) if sliding else (global_head_dim, global_kv)
        override = overrides.get(str(i), overrides.get(i, {}))
        dim, kv = int(override.get("head_dim", dim)), int(override.get("num_key_value_heads", kv))
        theta, angles, factor = _rope_from_hf(k, layer_type, dim, 10_000.0)
        specs.append(LayerSpec(sliding, dim, kv, theta, angles, factor, k_eq_v and not sliding))
    intermediate = int(k.req("intermediate_size"))
    wide = intermediate * 2 if k.opt("use_double_wide_mlp", False) else 0
    specs = _share_kv(specs, int(k.opt("num_kv_shared_layers", 0)), wide, k.source)
    moe = None
    if k.opt("enable_moe_block", False):
        moe = MoESpec(int(k.req("num_experts")), int(k.req("top_k_experts")), int(k.req("moe_intermediate_size")))
    per_layer = int(k.opt("hidden_size_per_layer_input", 0))
    if per_layer and int(k.opt("vocab_size_per_layer_input", k.req("vocab_size"))) != int(k.req("vocab_size")):
        raise ConfigError(f"{k.source}: vocab_size_per_layer_input differs from vocab_size (no Gemma 4 does that)")
    return ModelConfig(
        family="gemma4",
        layers=tuple(specs),
        norm_offset=0.0,
        attn_scale=1.0,
        final_softcap=k.opt("final_logit_softcapping"),
        v_norm=True,
        layer_scalar=True,
        moe=moe,
        per_layer_input=per_layer,
        **_hf_shared(k),
    )


def _share_kv(specs: list[LayerSpec], shared: int, wide_intermediate: int, source: str) -> list[LayerSpec]:
    """The last `shared` layers attend over the K / V of the last earlier layer of their kind (transformers'
    `kv_sharing_modes`, llama.cpp's `shared_kv_layers`); those layers' MLP is `wide_intermediate` wide when set."""
    if not shared:
        return specs
    first = len(specs) - shared
    if not 0 < first < len(specs):
        raise ConfigError(f"{source}: {shared} KV-sharing layers of {len(specs)} leave no layer that owns K / V")
    out = list(specs)
    for i in range(first, len(specs)):
        owners = [j for j in range(first) if specs[j].sliding == specs[i].sliding]
        if not owners:
            kind = "sliding" if specs[i].sliding else "full"
            raise ConfigError(f"{source}: layer {i} shares the K / V of a {kind} layer, and no earlier layer is one")
        out[i] = replace(specs[i], kv_source=owners[-1], k_eq_v=specs[owners[-1]].k_eq_v,
                         intermediate_size=wide_intermediate)
    return out


def _per_layer(value: Any, num_layers: int, key: str, source: str) -> list[Any]:
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != num_layers:
            raise ConfigError(f"{source}: {key} has {len(value)} entries for {num_layers} layers")
        return list(value)
    return [value] * num_layers


def _gemma3_from_gguf(k: _Keys) -> ModelConfig:
    num_layers = int(k.req("block_count"))
    hidden = int(k.req("embedding_length"))
    num_heads = int(k.req("attention.head_count"))
    head_dim = int(k.opt("attention.key_length", hidden // num_heads))
    num_kv = int(k.req("attention.head_count_kv"))
    # llama.cpp hard-codes Gemma 3's 5:1 pattern and 10k local base; linear scaling applies to global layers.
    scaling = k.opt("rope.scaling.type")
    factor = float(k.opt("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    if scaling not in (None, "none", "linear"):
        raise ConfigError(f"{k.source}: unsupported gemma3.rope.scaling.type {scaling!r}")
    global_theta = float(k.opt("rope.freq_base", 1_000_000.0))
    specs = tuple(
        LayerSpec(True, head_dim, num_kv, 10_000.0, head_dim // 2)
        if (i + 1) % 6
        else LayerSpec(False, head_dim, num_kv, global_theta, head_dim // 2, factor)
        for i in range(num_layers)
    )
    # llama.cpp: the 27B (62 layers) scales queries by hidden/heads, every other size by head_dim.
    pre_attn = hidden // num_heads if num_layers == 62 else head_dim
    return ModelConfig(
        family="gemma3",
        vocab_size=_gguf_vocab_size(k),
        hidden_size=hidden,
        intermediate_size=int(k.req("feed_forward_length")),
        num_heads=num_heads,
        layers=specs,
        sliding_window=int(k.req("attention.sliding_window")),
        rms_norm_eps=float(k.req("attention.layer_norm_rms_epsilon")),
        norm_offset=0.0,
        attn_scale=pre_attn**-0.5,
        final_softcap=k.opt("final_logit_softcapping"),
        v_norm=False,
        layer_scalar=False,
        tie_embeddings=True,
        max_position_embeddings=int(k.opt("context_length", 131_072)),
    )


def _gemma4_from_gguf(k: _Keys, tensor_names: set[str], rope_freqs: list[float] | None) -> ModelConfig:
    num_layers = int(k.req("block_count"))
    sliding = [bool(s) for s in _per_layer(k.req("attention.sliding_window_pattern"), num_layers,
                                           k.prefix + "attention.sliding_window_pattern", k.source)]
    kv_heads = _per_layer(k.req("attention.head_count_kv"), num_layers, k.prefix + "attention.head_count_kv", k.source)
    full_dim = int(k.req("attention.key_length"))
    swa_dim = int(k.req("attention.key_length_swa"))
    full_theta = float(k.req("rope.freq_base"))
    swa_theta = float(k.req("rope.freq_base_swa"))
    # llama.cpp freezes the unrotated dims with a rope_freqs tensor (1.0 = rotate, 1e30 = frozen).
    full_angles = sum(1 for f in rope_freqs if f == 1.0) if rope_freqs is not None else full_dim // 2
    specs = []
    for i, is_swa in enumerate(sliding):
        if is_swa:
            specs.append(LayerSpec(True, swa_dim, int(kv_heads[i]), swa_theta, swa_dim // 2))
        else:
            k_eq_v = f"blk.{i}.attn_v.weight" not in tensor_names
            specs.append(LayerSpec(False, full_dim, int(kv_heads[i]), full_theta, full_angles, 1.0, k_eq_v))
    widths = _per_layer(k.req("feed_forward_length"), num_layers, k.prefix + "feed_forward_length", k.source)
    shared = int(k.opt("attention.shared_kv_layers", 0))
    # llama.cpp's converter writes E2B / E4B's double-wide MLPs as a per-layer feed_forward_length
    wide = int(widths[-1]) if shared and int(widths[-1]) != int(widths[0]) else 0
    specs = _share_kv(specs, shared, wide, k.source)
    moe = None
    if any(name.endswith(".ffn_gate_inp.weight") for name in tensor_names):
        moe = MoESpec(int(k.req("expert_count")), int(k.req("expert_used_count")),
                      int(k.req("expert_feed_forward_length")))
    return ModelConfig(
        family="gemma4",
        vocab_size=_gguf_vocab_size(k),
        hidden_size=int(k.req("embedding_length")),
        intermediate_size=int(widths[0]),
        num_heads=int(_per_layer(k.req("attention.head_count"), num_layers, "attention.head_count", k.source)[0]),
        layers=tuple(specs),
        sliding_window=int(k.req("attention.sliding_window")),
        rms_norm_eps=float(k.req("attention.layer_norm_rms_epsilon")),
        norm_offset=0.0,
        attn_scale=1.0,
        final_softcap=k.opt("final_logit_softcapping"),
        v_norm=True,
        layer_scalar=True,
        tie_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=int(k.opt("context_length", 131_072)),
        moe=moe,
        per_layer_input=int(k.opt("embedding_length_per_layer_input", 0)),
    )


def _gguf_vocab_size(k: _Keys) -> int:
    vocab = k.opt("vocab_size")
    if vocab is not None:
        return int(vocab)
    tokens = k.raw.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ConfigError(f"{k.source}: missing {k.prefix}vocab_size and tokenizer.ggml.tokens")
    return len(tokens)

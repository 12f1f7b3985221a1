"""The DFlash drafter's config (z-lab's config.json), read and checked: what the drafter, its cache and the memory
plan are sized by."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import DrafterError


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    causal: tuple[bool, ...]  # per layer: causal inside the block
    window: tuple[int | None, ...]  # per layer: sliding window, None for full attention
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    # The reference loop multiplies the target's raw embedding by `dflash_config.input_embedding_scale`
    # (default 1.0). z-lab's Gemma 4 drafter config has no such key, so the reference feeds it unscaled
    # embeddings while vLLM/SGLang multiply by sqrt(hidden); we follow the reference with the config.
    input_embedding_scale: float
    output_multiplier: float
    final_softcap: float | None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DrafterConfig:
        dflash = raw.get("dflash_config") or {}

        def value(name: str, default: Any = None) -> Any:
            return dflash.get(name, raw.get(name, default))

        def required(name: str) -> Any:
            got = value(name)
            if got is None:
                raise DrafterError(f"{source}: the DFlash config has no {name!r}")
            return got

        if "dflash_config" not in raw and "block_size" not in raw:
            raise DrafterError(f"{source} is not a DFlash drafter config (no dflash_config)")
        if value("conv_kernel_size") is not None or value("selector_rank") is not None:
            raise DrafterError(f"{source}: DFlash2 drafters (convolutions, candidate selector) are not supported")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise DrafterError(f"{source}: hidden_act {act!r} is not supported (DFlash drafters use silu)")
        if raw.get("attention_bias"):
            raise DrafterError(f"{source}: attention_bias is not supported")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise DrafterError(f"{source}: RoPE type {rope.get('rope_type')!r} is not supported")
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0)))

        num_layers = int(required("num_hidden_layers"))
        hidden = int(required("hidden_size"))
        heads = int(required("num_attention_heads"))
        layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
        if len(layer_types) != num_layers:
            raise DrafterError(f"{source}: {len(layer_types)} layer_types for {num_layers} layers")
        forced_causal = raw.get("is_causal", dflash.get("causal"))
        sliding = [t == "sliding_attention" for t in layer_types]
        window = raw.get("sliding_window")
        if any(sliding) and not window:
            raise DrafterError(f"{source}: sliding layers but no sliding_window")
        kv_heads = int(value("num_key_value_heads", heads))
        if heads % kv_heads:
            raise DrafterError(f"{source}: {heads} attention heads are not a multiple of {kv_heads} KV heads")
        target_ids = value("target_layer_ids")
        if target_ids is None:
            target_ids = build_target_layer_ids(int(required("num_target_layers")), num_layers)
        softcap = value("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(required("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(value("head_dim") or hidden // heads),
            rms_norm_eps=float(value("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            causal=tuple(s if forced_causal is None else bool(forced_causal) for s in sliding),
            window=tuple(int(window) if s else None for s in sliding),
            block_size=int(value("block_size", 16)),
            mask_token_id=int(required("mask_token_id")),
            target_layer_ids=tuple(int(i) for i in target_ids),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_softcap=float(softcap) if softcap else None,
        )

    def with_context_window(self, tokens: int) -> DrafterConfig:
        """The drafter reading at most the last `tokens` of the context in every layer (`--draft-ctx`): a full layer
        gets that window, a sliding one keeps the smaller of its own and it. A bidirectional layer's window counts
        back from the block's last position (every query of a block sees the same keys), a causal one's from each
        query's."""
        if tokens < self.block_size:
            raise DrafterError(f"a drafter context window of {tokens} tokens is shorter than the drafter's block "
                               f"({self.block_size})")
        return replace(self, window=tuple(tokens if w is None else min(w, tokens) for w in self.window))


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: evenly spaced from layer 1 to layer N-3 (used when the config names none)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]

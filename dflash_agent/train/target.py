"""Greedy continuations of many prompts at once on the frozen target, capturing the features the
drafter learns from (the outputs of chosen decoder layers) on the way.

The engine's `GemmaModel.forward` runs one sequence. Decoding one sequence at a time on a CPU reads
every weight (and the 262k-row LM head) once per token; a batch of rows amortizes that read, which
makes generating training data ~5-10x faster. This is the same decoder math over a batch of
equal-length prompts, built from the model's own modules and weights (projections, norms, MLPs,
RoPE); tests check it token for token and feature for feature against `GemmaModel.forward`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..engine.model import Attention, DecoderLayer, GemmaModel, _rope_key, rope_tables, rotate

log = logging.getLogger(__name__)

PREFILL_CHUNK = 256  # bounds the [rows, heads, T, T] attention scores of the prompt forward


@dataclass
class Continuation:
    tokens: list[int]  # prompt + greedy continuation (ending at a stop token or the length limit)
    prompt_len: int
    features: torch.Tensor  # [len(tokens), n_layers * hidden]: the captured layers at every position


class BatchGenerator:
    """Greedy decoding of equal-length prompts in batches, with feature capture. Rows share
    positions, so one causal mask and one RoPE table per layer type serve the whole batch."""

    def __init__(self, model: GemmaModel, capture: tuple[int, ...], stop_ids: frozenset[int]) -> None:
        bad = [i for i in capture if not 0 <= i < model.config.num_layers]
        if bad:
            raise ValueError(f"target layer {bad[0]} does not exist (the target has {model.config.num_layers} layers)")
        self.model, self.capture, self.stop_ids = model, capture, stop_ids
        # One RoPE table per distinct layer RoPE (sliding and global layers differ), as the model keeps.
        self._inv_freq = {
            _rope_key(spec): torch.tensor(spec.inv_freq(), dtype=torch.float32, device=model.device)
            for spec in model.config.layers
        }

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new: int) -> list[Continuation]:
        if not prompts:
            return []
        if max_new < 1:
            raise ValueError(f"max_new must be >= 1, got {max_new}")
        P = len(prompts[0])
        if any(len(p) != P for p in prompts):
            raise ValueError("every prompt in a batch must have the same length")
        model, cfg = self.model, self.model.config
        n, total = len(prompts), P + max_new
        device, dtype = model.device, model.dtype
        k_cache = [torch.zeros(n, total, s.num_kv_heads, s.head_dim, dtype=dtype, device=device) for s in cfg.layers]
        v_cache = [torch.zeros_like(k) for k in k_cache]
        features = torch.zeros(n, total, len(self.capture) * cfg.hidden_size, dtype=dtype, device=device)
        tokens = torch.zeros(n, total, dtype=torch.long, device=device)
        tokens[:, :P] = torch.tensor(prompts, device=device)
        for start in range(0, P, PREFILL_CHUNK):
            last = self._forward(tokens[:, start : min(P, start + PREFILL_CHUNK)], k_cache, v_cache, start, features)
        lengths = [total] * n
        for pos in range(P, total):
            tokens[:, pos] = model.logits(last).argmax(-1)
            # Every token is fed back, the last one too, for its features.
            last = self._forward(tokens[:, pos : pos + 1], k_cache, v_cache, pos, features)
            for row in range(n):
                if lengths[row] == total and int(tokens[row, pos]) in self.stop_ids:
                    lengths[row] = pos + 1
            if all(length < total for length in lengths):
                break
        return [
            Continuation(tokens[r, : lengths[r]].tolist(), P, features[r, : lengths[r]].clone()) for r in range(n)
        ]

    def _forward(
        self,
        ids: torch.Tensor,  # [rows, T]
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        start: int,
        features: torch.Tensor,
    ) -> torch.Tensor:
        """Run T tokens of every row at positions start..; returns the last position's hidden [rows, H]."""
        model, cfg = self.model, self.model.config
        end = start + ids.shape[1]
        x = model.embed_tokens.weight[ids] * torch.tensor(cfg.embed_scale, dtype=model.dtype)
        pos = torch.arange(start, end, device=model.device)
        keys = torch.arange(end, device=model.device)
        causal = keys[None, :] <= pos[:, None]
        masks = {False: causal, True: causal & (pos[:, None] - keys[None, :] < cfg.sliding_window)}
        tables = {key: rope_tables(inv_freq, pos, model.dtype) for key, inv_freq in self._inv_freq.items()}
        width = cfg.hidden_size
        for i, (layer, spec) in enumerate(zip(model.layers, cfg.layers)):
            x = _layer(layer, x, *tables[_rope_key(spec)], k_cache[i], v_cache[i], start, masks[spec.sliding])
            if i in self.capture:
                j = self.capture.index(i)
                features[:, start:end, j * width : (j + 1) * width] = x
        return x[:, -1]


def _layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
    """`DecoderLayer.forward` over [rows, T, hidden]."""
    x = x + layer.post_attention_layernorm(_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, k_cache,
                                                      v_cache, start, mask))
    x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
    if layer.layer_scalar is not None:
        x = x * layer.layer_scalar
    return x


def _attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
    """`Attention.forward` over [rows, T, hidden], writing the new K/V at start.. of a [rows, max_len] cache."""
    n, T, d = x.shape[0], x.shape[1], attn.spec.head_dim
    end = start + T
    q = rotate(attn.q_norm(attn.q_proj(x).view(n, T, attn.num_heads, d)), cos, sin)
    k_raw = attn.k_proj(x).view(n, T, -1, d)
    v = k_raw if attn.v_proj is None else attn.v_proj(x).view(n, T, -1, d)
    k = rotate(attn.k_norm(k_raw), cos, sin)
    if attn.v_norm is not None:
        v = attn.v_norm(v)
    k_cache[:, start:end] = k
    v_cache[:, start:end] = v
    keys, values = k_cache[:, :end], v_cache[:, :end]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=attn.scale,
        enable_gqa=keys.shape[2] != attn.num_heads,
    )
    return attn.o_proj(out.transpose(1, 2).reshape(n, T, attn.num_heads * d))

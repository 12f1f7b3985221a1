"""The DFlash training forward: many draft blocks of one sequence in a single pass.

At inference a block [anchor, mask, ..., mask] at positions p..p+B-1 attends to the context K/V of
positions < p (the target's features of the committed tokens) and to itself. Training samples A
anchors from a sequence and runs all A blocks as one [A*B] query set over one key set
[context (L) | blocks (A*B)], with a mask that gives every block exactly the keys it would see at
inference: context strictly before its anchor (within the window on sliding layers) and its own
block (causal on sliding layers, bidirectional on full ones). Blocks never see each other.

It runs the inference drafter's own forward (`Drafter.layers_forward`, with each layer's context keys
projected from the features and this mask), so a trained drafter is the same network the engine runs;
tests check this forward row for row against `Drafter.draft`.
"""

from __future__ import annotations

import torch

from ..engine.formats.drafter_config import DrafterConfig
from ..engine.model.drafter import Drafter, DraftLayerPlan


def sample_anchors(length: int, prompt_len: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct anchor positions, sorted, where a block has at least one label.

    An anchor is a committed token whose block predicts the tokens after it. The first anchor at
    inference is the first generated token (position prompt_len): the prompt's own next-token
    prediction comes from the target's prefill, never from a draft. So anchors lie in
    [prompt_len, length - 2], and every label is a token the target itself generated.
    """
    first, last = prompt_len, length - 2
    if last < first:
        return torch.empty(0, dtype=torch.long)
    choices = last - first + 1
    picked = torch.randperm(choices, generator=generator)[:count]
    return (picked + first).sort().values


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[A, B] absolute positions of every block token."""
    return anchors[:, None] + torch.arange(block_size, device=anchors.device)[None, :]


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[A, B-1] the tokens each block's positions 1..B-1 must predict; -1 past the sequence end."""
    pos = block_positions(anchors, block_size)[:, 1:]
    inside = pos < tokens.shape[0]
    return torch.where(inside, tokens[pos.clamp(max=tokens.shape[0] - 1)], -1)


def block_mask(config: DrafterConfig, layer: int, anchors: torch.Tensor, block_size: int,
               context_len: int) -> torch.Tensor:
    """[A*B, context_len + A*B] bool (True = visible) for one drafter layer."""
    causal, window = config.causal[layer], config.window[layer]
    A, B, device = anchors.shape[0], block_size, anchors.device
    q_pos = block_positions(anchors, B).reshape(-1, 1)  # [A*B, 1]
    q_anchor = anchors.repeat_interleave(B)[:, None]
    ctx_pos = torch.arange(context_len, device=device)[None, :]
    context = ctx_pos < q_anchor
    if window is not None:  # a bidirectional layer's counts back from its block's last position
        context &= (q_pos if causal else q_anchor + B - 1) - ctx_pos < window
    q_block = torch.arange(A, device=device).repeat_interleave(B)[:, None]
    q_index = torch.arange(B, device=device).repeat(A)[:, None]
    k_block, k_index = q_block.T, q_index.T
    own = q_block == k_block
    if causal:
        own &= k_index <= q_index
    # A block is far shorter than any window, so the window never cuts inside one.
    return torch.cat((context, own), dim=1)


def forward_blocks(drafter: Drafter, features: torch.Tensor, block_embeds: torch.Tensor,
                   anchors: torch.Tensor) -> torch.Tensor:
    """Hidden states [A*B, H] of A blocks at once.

    features: [L, n_target_layers * target_hidden], the target's features of the sequence (only
    positions before the last anchor are read). block_embeds: [A*B, H], each block's input
    embeddings ([anchor token, mask, ...] times the embedding scale), blocks in anchor order.
    """
    A = anchors.shape[0]
    B = block_embeds.shape[0] // A
    context_len = int(anchors.max())
    ctx = drafter.hidden_norm(drafter.fc(features[:context_len].to(drafter.dtype)))
    ctx_cos, ctx_sin = drafter.rope(torch.arange(context_len, device=features.device))
    q_cos, q_sin = drafter.rope(block_positions(anchors, B).reshape(-1))
    masks: dict[tuple, torch.Tensor] = {}
    plans = []
    for i, layer in enumerate(drafter.layers):
        kind = (drafter.config.causal[i], drafter.config.window[i])
        if kind not in masks:
            masks[kind] = block_mask(drafter.config, i, anchors, B, context_len)
        ctx_k, ctx_v = layer.self_attn.context_kv(ctx, ctx_cos, ctx_sin)
        plans.append(DraftLayerPlan("concat", ctx_k, ctx_v, masks[kind]))
    return drafter.layers_forward(block_embeds.to(drafter.dtype), (q_cos, q_sin), plans)

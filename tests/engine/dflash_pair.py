"""A tiny random Gemma 4 target and a tiny random DFlash drafter saved as real checkpoints, plus
z-lab's reference drafter over the same weights (tests import this; it is not a test module)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.references import VOCAB, save_reference

DRAFT_WINDOW = 12  # the drafter's sliding window; the target's is 8
BLOCK = 8
MASK_ID = 4
TARGET_LAYER_IDS = [0, 2]


def drafter_config(**overrides):
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10_000.0,
        max_position_embeddings=512, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=DRAFT_WINDOW,
        use_sliding_window=True,
    )
    config.block_size = BLOCK
    config.num_target_layers = 4
    config.final_logit_softcapping = 5.0
    config.dflash_config = {"mask_token_id": MASK_ID, "target_layer_ids": TARGET_LAYER_IDS}
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def save_drafter(path: Path, seed: int = 2, **overrides):
    """z-lab's DFlashDraftModel with random weights (norms perturbed), saved with save_pretrained."""
    from dflash.model import DFlashDraftModel

    torch.manual_seed(seed)
    model = DFlashDraftModel(drafter_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                # Larger than the init so the random drafter is confident and sometimes right.
                p.mul_(3.0)
    model.eval()
    model.save_pretrained(path)
    return model


def save_pair(root: Path):
    """(reference target, reference drafter, target dir, drafter dir)."""
    target_dir, drafter_dir = root / "target", root / "drafter"
    target = save_reference("gemma4", target_dir)
    drafter = save_drafter(drafter_dir)
    return target, drafter, target_dir, drafter_dir

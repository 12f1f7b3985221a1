"""Gemma 4 GGUFs at the family's real shapes with random weights, written block by block: no float model in memory,
so the 16 GiB 31B writes on a machine with less RAM than that (nothing real can be downloaded here):

    python -m dflash_agent.bench.real_shapes gemma4-e2b /tmp/e2b-q4_0.gguf
    dflash-agent bench --model /tmp/e2b-q4_0.gguf

The metadata is what llama.cpp's converter (convert_hf_to_gguf.py, Gemma4Model) writes for the model's config.json
keys, in its order; the tokenizer is the embedded model's 262,144 pieces, with Gemma 4's special tokens at their ids
(`<|turn>` 105, `<turn|>` 106, ...), so the chat layer renders Gemma 4 prompts. Weights are random blocks of the
checkpoint's types (bench.synthetic.quant_types: Q4_0 as Google's QAT GGUF, or Q4_K_M as llama-quantize mixes it)
whose float16 scales give each output unit variance, and norms near 1, as a trained model's.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..engine.formats.config import ModelConfig
from ..engine.formats.gguf_names import gguf_name
from .synthetic import QUANTS, gemma4_26b_a4b_config, gemma4_31b_config, quant_types

log = logging.getLogger(__name__)
T = GGMLQuantizationType

# Gemma 4's special tokens (shared reference gemma4.md section 5) written over the embedded tokenizer's pieces.
SPECIAL_TOKENS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 46: "<|tool>", 47: "<tool|>",
                  48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>", 51: "<tool_response|>",
                  52: '<|"|>', 98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>",
                  106: "<turn|>"}
_ROWS_PER_CHUNK_BYTES = 64 << 20  # random blocks generated and written this many bytes at a time


def _gemma4_small(pattern: int, **shape) -> ModelConfig:
    """The text config.json keys Gemma 4's two small members (E2B, E4B) share, plus `shape`: per-layer inputs of
    256, the last layers reading earlier layers' K / V, sliding windows of 512, every `pattern`-th layer full (the
    layer before the first KV-sharing one is full and the one before it sliding, as llama.cpp's loader requires)."""
    layers = shape["num_hidden_layers"]
    return ModelConfig.from_hf_dict(dict(
        model_type="gemma4_text", vocab_size=262144, head_dim=256, global_head_dim=512, attention_k_eq_v=False,
        sliding_window=512, rms_norm_eps=1e-6, final_logit_softcapping=30.0, tie_word_embeddings=True,
        hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, max_position_embeddings=131072,
        num_attention_heads=8,
        layer_types=[("full_attention" if (i + 1) % pattern == 0 else "sliding_attention") for i in range(layers)],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1_000_000.0},
        },
        **shape,
    ))


def gemma4_e2b_config() -> ModelConfig:
    """google/gemma-4-E2B-it's text config: 35 layers 1536 wide (4 sliding to 1 full), one KV head, the last 20
    layers sharing K / V and twice as wide an MLP (12288)."""
    return _gemma4_small(5, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_key_value_heads=1,
                         num_global_key_value_heads=1, num_kv_shared_layers=20, use_double_wide_mlp=True)


def gemma4_e4b_config() -> ModelConfig:
    """google/gemma-4-E4B-it's text config: 42 layers 2560 wide (5 sliding to 1 full), two KV heads, the last 18
    layers sharing K / V."""
    return _gemma4_small(6, hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_key_value_heads=2,
                         num_global_key_value_heads=2, num_kv_shared_layers=18, use_double_wide_mlp=False)


SHAPES: dict[str, Callable[[], ModelConfig]] = {
    "gemma4-e2b": gemma4_e2b_config,
    "gemma4-e4b": gemma4_e4b_config,
    "gemma4-26b-a4b": gemma4_26b_a4b_config,
    "gemma4-31b": gemma4_31b_config,
}


def _add_metadata(writer: gguf.GGUFWriter, config: ModelConfig, quant: str) -> None:
    """The keys convert_hf_to_gguf.py's Gemma4Model writes (TextModel, Gemma3Model, then Gemma4Model's
    set_gguf_parameters), from the config they come from."""
    full = next(s for s in config.layers if not s.sliding)
    swa = next(s for s in config.layers if s.sliding)
    first_shared = next((i for i, s in enumerate(config.layers) if s.kv_source is not None), config.num_layers)
    sliding = [s.sliding for s in config.layers]
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    widths = [config.layer_intermediate_size(i) for i in range(config.num_layers)]
    # the converter writes the scalar, then overwrites it with the per-layer widths of a double-wide MLP
    writer.add_feed_forward_length(widths if len(set(widths)) > 1 else config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_rope_freq_base(full.rope_theta)
    writer.add_rope_freq_base_swa(swa.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.moe is not None:
        writer.add_expert_count(config.moe.num_experts)
        writer.add_expert_used_count(config.moe.top_k)
    writer.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M}[quant])
    writer.add_final_logit_softcapping(config.final_softcap)
    writer.add_sliding_window(config.sliding_window)
    writer.add_shared_kv_layers(config.num_layers - first_shared)
    writer.add_embedding_length_per_layer_input(config.per_layer_input)
    writer.add_sliding_window_pattern(sliding)
    writer.add_key_length(full.head_dim)
    writer.add_value_length(full.head_dim)
    writer.add_key_length_swa(swa.head_dim)
    writer.add_value_length_swa(swa.head_dim)
    if config.moe is not None:
        writer.add_expert_feed_forward_length(config.moe.intermediate_size)
    kv_heads = [s.num_kv_heads for s in config.layers]
    # per layer where the full layers' differ (num_global_key_value_heads), else the converter's scalar
    writer.add_head_count_kv(kv_heads if len(set(kv_heads)) > 1 else kv_heads[0])
    writer.add_rope_dimension_count(full.head_dim)
    writer.add_rope_dimension_count_swa(swa.head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """The embedded model's SentencePiece vocabulary (the size of Gemma 4's) with Gemma 4's special tokens: its first
    `vocab` pieces (a smaller test model's), and byte pieces after them for a larger one."""
    from ..engine.formats.gguf import read_gguf
    from ..engine.load.weights import EMBEDDED, resolve_model_path

    fields = read_gguf(resolve_model_path(EMBEDDED)).fields
    tokens = list(fields["tokenizer.ggml.tokens"])[:vocab]
    types = np.asarray(fields["tokenizer.ggml.token_type"])[:vocab].copy()
    scores = np.asarray(fields["tokenizer.ggml.scores"], dtype=np.float32)[:vocab]
    extra = vocab - len(tokens)
    if extra > 0:
        tokens += [f"<extra_{i}>" for i in range(extra)]
        types = np.concatenate([types, np.full(extra, int(gguf.TokenType.USER_DEFINED), dtype=types.dtype)])
        scores = np.concatenate([scores, np.zeros(extra, dtype=np.float32)])
    for i, piece in SPECIAL_TOKENS.items():
        if i >= vocab:
            continue
        tokens[i] = piece
        types[i] = gguf.TokenType.CONTROL
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_token_list(tokens)
    writer.add_token_scores(scores.tolist())
    writer.add_token_types(types.astype(np.int32).tolist())
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)


def _half(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float16).view(np.uint8)


def random_blocks(qtype: GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, k / block * size] uint8: random quants of `qtype` whose float16 scales give outputs of unit variance
    against unit inputs (each weight's spread about 1 / sqrt(k)); every float16 field is set, so none is NaN."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = np.frombuffer(rng.bytes(rows * (k // block) * size), dtype=np.uint8).reshape(rows, k // block, size)
    blocks = blocks.copy()
    spread = 1.0 / np.sqrt(k)
    if qtype == T.Q4_0:  # (q - 8) d, q uniform in 0..15: a spread of 4.6 d
        blocks[..., 0:2] = _half(spread / 4.6)
    elif qtype == T.Q5_0:
        blocks[..., 0:2] = _half(spread / 9.2)
    elif qtype == T.Q8_0:
        blocks[..., 0:2] = _half(spread / 74.0)
    elif qtype in (T.Q4_K, T.Q5_K):  # d sc q - dmin m: sc, m up to 63, q up to 15 (31)
        levels = 4.6 if qtype == T.Q4_K else 9.2
        blocks[..., 0:2] = _half(spread / (levels * 32))
        blocks[..., 2:4] = _half(spread / (levels * 32) * 8)
    elif qtype == T.Q6_K:  # d sc (q - 32): int8 sc, q uniform in 0..63 (spread 18.5)
        blocks[..., 208:210] = _half(spread / (18.5 * 74))
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return blocks.reshape(rows, -1)


def _float_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("layer_scalar"):
        return np.ones(shape, dtype=np.float32)
    if name.endswith(("router.scale", "router.per_expert_scale")):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("router.proj.weight"):  # a trained router's clear choices
        return (rng.standard_normal(shape) * 3.0 / np.sqrt(shape[-1])).astype(np.float32)
    return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)  # the norms (no +1 in Gemma 4's files)


def _chunks(qtype: GGMLQuantizationType | None, name: str, shape: tuple[int, ...],
            rng: np.random.Generator) -> Iterator[np.ndarray]:
    if qtype is None:
        yield _float_tensor(name, shape, rng)
        return
    k = shape[-1]
    rows = int(np.prod(shape[:-1]))
    block, size = GGML_QUANT_SIZES[qtype]
    step = max(1, _ROWS_PER_CHUNK_BYTES // (k // block * size))
    for start in range(0, rows, step):
        yield random_blocks(qtype, min(step, rows - start), k, rng)


def real_shape_tensors(config: ModelConfig, quant: str) -> list[tuple[str, str, tuple[int, ...],
                                                                      GGMLQuantizationType | None]]:
    """(GGUF name, our name, shape in torch order, type or None for float32) of every tensor of the checkpoint."""
    import torch

    from ..engine.model.gemma import GemmaModel

    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in GemmaModel(config, device="meta").state_dict().items()}
    types = quant_types(config, quant)
    out = [(gguf_name(ours), ours, shape, types[ours]) for ours, shape in shapes.items()]
    full = next(s for s in config.layers if not s.sliding)
    out.append(("rope_freqs.weight", "", (full.head_dim // 2,), None))
    return out


def _rope_freqs(config: ModelConfig) -> np.ndarray:
    """llama.cpp's divisors that freeze the full layers' unrotated dims (1.0 rotates, 1e30 freezes)."""
    full = next(s for s in config.layers if not s.sliding)
    return np.array([1.0] * full.rope_angles + [1e30] * (full.head_dim // 2 - full.rope_angles),
                    dtype=np.float32)


def write_real_shape_gguf(path: Path, config: ModelConfig, quant: str = "Q4_0", name: str = "gemma4",
                          seed: int = 0, progress: Callable[[int, int], None] | None = None,
                          weights: bool = True) -> int:
    """Write a GGUF of random weights at config's shapes to path, a tensor block at a time; returns its size.
    progress(bytes written, total) after each chunk; weights False: the metadata and tokenizer only (what the
    converter's --vocab-only writes)."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quantization {quant!r} ({', '.join(QUANTS)})")
    rng = np.random.default_rng(seed)
    tensors = real_shape_tensors(config, quant)
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_name(f"random {name} {quant}")
    _add_metadata(writer, config, quant)
    _add_tokenizer(writer, config.vocab_size)
    if not weights:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        return path.stat().st_size
    total = 0
    for tensor_name, _, shape, qtype in tensors:
        if qtype is None:
            writer.add_tensor_info(tensor_name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
            total += 4 * int(np.prod(shape))
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block * size
            writer.add_tensor_info(tensor_name, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8),
                                   nbytes, raw_dtype=qtype)
            total += nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    done = 0
    for tensor_name, _, shape, qtype in tensors:
        writer.tensors[0].pop(tensor_name)
        writer.write_padding(fout, fout.tell())
        written = 0
        chunks = [_rope_freqs(config)] if tensor_name == "rope_freqs.weight" else _chunks(qtype, tensor_name, shape,
                                                                                              rng)
        for chunk in chunks:
            chunk.tofile(fout)
            written += chunk.nbytes
            done += chunk.nbytes
            if progress is not None:
                progress(done, total)
        writer.write_padding(fout, written)
    writer.close()
    return path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--quant", choices=QUANTS, default="Q4_0")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    last = [0]

    def report(done: int, total: int) -> None:
        if done - last[0] >= 1 << 30 or done == total:
            last[0] = done
            log.info("%.1f / %.1f GiB", done / 2**30, total / 2**30)

    try:
        size = write_real_shape_gguf(args.out, SHAPES[args.model](), args.quant, args.model, args.seed, report)
    except OSError as e:
        sys.exit(f"real_shapes: {e}")
    log.info("wrote %s (%.2f GiB)", args.out, size / 2**30)


if __name__ == "__main__":
    main()

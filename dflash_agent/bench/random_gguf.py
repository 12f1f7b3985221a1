"""A Gemma 3 GGUF of random float16 weights at a shape of one's choosing, with the embedded model's tokenizer: a model
whose layers, not its 262k-row LM head, carry most of the bytes a token reads (the embedded 270M's Q8_0 head is 60% of
them), for `bench` against llama.cpp once the peer's llama-quantize has made it Q4_K_M:

    python -m dflash_agent.bench.random_gguf /tmp/layers-f16.gguf
    $LLAMA_CPP_BIN/llama-quantize /tmp/layers-f16.gguf /tmp/layers-q4_k_m.gguf Q4_K_M
    dflash-agent bench --model /tmp/layers-q4_k_m.gguf

The default shape (hidden 1024, 40 layers of an MLP of 4096, 8 heads of 128 over 2 KV heads) has widths that are
multiples of 256, so Q4_K_M quantizes every matrix to its K-quants (rows of 640, the embedded model's, fall back to
Q5_0 / Q8_0): about 370 MB of layers against a 220 MB Q6_K head.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ..engine.load.weights import EMBEDDED, resolve_model_path

log = logging.getLogger(__name__)

# The embedded file's fields that describe its shape or its weights: written anew; the rest (the tokenizer, RoPE,
# the sliding window, the norm epsilon) are copied.
SHAPE_FIELDS = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "attention.key_length", "attention.value_length")


@dataclass(frozen=True)
class Shape:
    hidden: int = 1024
    layers: int = 40
    intermediate: int = 4096
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128


def write_random_gemma3(path: Path, shape: Shape = Shape(), seed: int = 0) -> None:
    """Write a Gemma 3 GGUF of random weights at `shape` (float16 matrices, float32 norms) to path."""
    source = gguf.GGUFReader(resolve_model_path(EMBEDDED))
    arch = "gemma3"
    writer = gguf.GGUFWriter(str(path), arch)
    skip = {f"{arch}.{name}" for name in SHAPE_FIELDS} | {"general.architecture", "general.file_type",
                                                        "general.name", "general.size_label"}
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, kind)
    writer.add_name(f"random gemma3 {shape.hidden}x{shape.layers}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:  # [rows (outputs), cols (inputs)], unit-variance outputs
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)

    def norm(n: int) -> np.ndarray:  # the file stores 1 + w
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    h, d = shape.hidden, shape.head_dim
    writer.add_tensor("token_embd.weight", matrix(vocab, h))
    writer.add_tensor("output_norm.weight", norm(h))
    for i in range(shape.layers):
        log.info("layer %d/%d", i + 1, shape.layers)
        for name, rows, cols in (("attn_q", shape.heads * d, h), ("attn_k", shape.kv_heads * d, h),
                                 ("attn_v", shape.kv_heads * d, h), ("attn_output", h, shape.heads * d),
                                 ("ffn_gate", shape.intermediate, h), ("ffn_up", shape.intermediate, h),
                                 ("ffn_down", h, shape.intermediate)):
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(rows, cols))
        for name, n in (("attn_norm", h), ("post_attention_norm", h), ("ffn_norm", h), ("post_ffw_norm", h),
                        ("attn_q_norm", d), ("attn_k_norm", d)):
            writer.add_tensor(f"blk.{i}.{name}.weight", norm(n))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    defaults = Shape()
    for name in Shape.__dataclass_fields__:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shape = Shape(**{name: getattr(args, name) for name in Shape.__dataclass_fields__})
    write_random_gemma3(args.out, shape, args.seed)
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()

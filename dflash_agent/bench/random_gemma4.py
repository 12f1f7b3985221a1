"""A Gemma 4 GGUF of random weights in one of the family's layouts, written by llama.cpp's own converter from a
transformers model, for `bench` against llama.cpp once the peer's llama-quantize has quantized it (no real
26B-A4B or E2B weights can be downloaded here):

    python -m dflash_agent.bench.random_gemma4 moe /tmp/moe-f16.gguf
    $LLAMA_CPP_BIN/llama-quantize /tmp/moe-f16.gguf /tmp/moe-q4_k_m.gguf Q4_K_M
    dflash-agent bench --model /tmp/moe-q4_k_m.gguf

Layouts, each 26B-A4B's or E2B's structure at a width that keeps the layers, not the embedding, the bytes a token
reads (the vocabulary is a 128-piece byte tokenizer):
- moe: 6 layers 1024 wide, each a dense MLP of 2048 beside 32 experts of 512, 8 a token;
- e2b: 12 layers 1024 wide with per-layer inputs of 256, the last 4 reading earlier layers' K / V with MLPs twice
  as wide (4096).
The converter comes from llama.cpp's sources: $LLAMA_CPP_SRC, else where scripts/llama-cpp.sh unpacks them.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PEER_SOURCES = Path.home() / ".cache/dflash-agent-peers/llama.cpp-11434.0.0/src/llama.cpp"
VOCAB = 128
LAYOUTS = ("moe", "e2b")


def converter_script() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py ($LLAMA_CPP_SRC, else the peer build's sources), None where absent."""
    script = Path(os.environ.get("LLAMA_CPP_SRC", PEER_SOURCES)) / "convert_hf_to_gguf.py"
    return script if script.is_file() else None


def save_byte_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """A byte-fallback BPE tokenizer.json of `vocab` pieces (with one merge, which llama.cpp's loader requires):
    what the converter's Gemma 4 vocabulary reader accepts."""
    import tokenizers
    from tokenizers import decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    pieces = {piece: i for i, piece in enumerate(("<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "ab"))}
    for i in range(vocab - len(pieces)):
        pieces[f"<0x{i:02X}>"] = len(pieces)
    backend = tokenizers.Tokenizer(BPE(pieces, [("a", "b")], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(path)


def convert(hf_dir: Path, out: Path, outtype: str) -> Path:
    """llama.cpp's converter on a transformers checkpoint directory (with its tokenizer): out."""
    script = converter_script()
    if script is None:
        raise FileNotFoundError(f"no convert_hf_to_gguf.py in $LLAMA_CPP_SRC or {PEER_SOURCES}: "
                                "scripts/llama-cpp.sh unpacks llama.cpp's sources there")
    result = subprocess.run([sys.executable, str(script), str(hf_dir), "--outfile", str(out), "--outtype", outtype],
                            capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {result.stderr[-2000:]}")
    return out


def layout_config(layout: str, hidden: int = 1024):
    """transformers' Gemma4TextConfig of a layout (see the module doc)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_attention_heads=8, head_dim=128, global_head_dim=256,
                  sliding_window=512, final_logit_softcapping=30.0, vocab_size_per_layer_input=VOCAB,
                  max_position_embeddings=4096)
    if layout == "moe":
        return transformers.Gemma4TextConfig(
            **common, intermediate_size=2 * hidden, num_hidden_layers=6, num_key_value_heads=2,
            num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
            layer_types=["sliding_attention"] * 5 + ["full_attention"], enable_moe_block=True, num_experts=32,
            top_k_experts=8, moe_intermediate_size=hidden // 2)
    if layout == "e2b":  # llama.cpp's loader wants the last two layers before the shared ones sliding, then full
        return transformers.Gemma4TextConfig(
            **common, intermediate_size=4 * hidden, num_hidden_layers=12, num_key_value_heads=1,
            hidden_size_per_layer_input=256, num_kv_shared_layers=4, use_double_wide_mlp=True,
            layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 3)
    raise ValueError(f"unknown layout {layout!r} (one of {', '.join(LAYOUTS)})")


def write_random_gemma4(path: Path, layout: str, hidden: int = 1024, seed: int = 0) -> None:
    """Write a float16 Gemma 4 GGUF of random weights in `layout` to path, through llama.cpp's converter."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(layout_config(layout, hidden))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # away from the identity init, as a trained model's
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
            elif name.endswith("router.proj.weight"):  # a trained router's clear choices, not init's near ties
                p.mul_(30.0)
    with tempfile.TemporaryDirectory() as tmp:
        log.info("writing the transformers checkpoint")
        model.save_pretrained(tmp)
        save_byte_tokenizer(Path(tmp))
        log.info("converting with llama.cpp's convert_hf_to_gguf.py")
        convert(Path(tmp), path, "f16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layout", choices=LAYOUTS)
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        write_random_gemma4(args.out, args.layout, args.hidden, args.seed)
    except (FileNotFoundError, RuntimeError) as e:
        sys.exit(f"random_gemma4: {e}")
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()

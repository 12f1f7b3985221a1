"""Gemma 4 26B-A4B and E2B / E4B as llama.cpp's own converter writes them (convert_hf_to_gguf.py from the
llama.cpp sources: $LLAMA_CPP_SRC, else where scripts/llama-cpp.sh unpacks them), against transformers and
against llama-server running the same file ($LLAMA_CPP_BIN)."""

import httpx
import pytest
import torch

from dflash_agent.bench.random_gemma4 import convert, converter_script
from dflash_agent.bench.random_gemma4 import save_byte_tokenizer as save_tokenizer
from dflash_agent.engine.load.weights import build_model, open_checkpoint
from dflash_agent.engine.runner import StepRunner
from tests.helpers.references import CONFIGS, PROMPT_LEN, VOCAB, save_assistant, save_reference


def _converter() -> None:
    if converter_script() is None:
        pytest.skip("no llama.cpp sources with convert_hf_to_gguf.py ($LLAMA_CPP_SRC)")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def converted(request, tmp_path_factory):
    """(transformers' model, the f32 GGUF and the Q8_0 GGUF llama.cpp's converter wrote from it)."""
    _converter()
    root = tmp_path_factory.mktemp(request.param)
    ref = save_reference(request.param, root / "hf")
    save_tokenizer(root / "hf")
    return ref, convert(root / "hf", root / "f32.gguf", "f32"), convert(root / "hf", root / "q8.gguf", "q8_0")


def test_converted_gguf_matches_transformers(converted):
    ref, gguf, _ = converted
    ours = build_model(open_checkpoint(gguf), "cpu", torch.float32, progress=False)
    ids = torch.randint(0, VOCAB, (21,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    got = ours(ids, ours.new_cache(64), logits_at=torch.arange(21)).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_q8_0_gguf_loads_what_gguf_py_dequantizes(converted):
    """The converter's Q8_0 file, experts and per-layer tables quantized too: every tensor we load equals
    gguf-py's dequantization of it."""
    import gguf

    from dflash_agent.engine.formats.gguf_names import gguf_tensor_name

    ref, _, path = converted
    state = build_model(open_checkpoint(path), "cpu", torch.float32, progress=False).state_dict()
    quantized = []
    for tensor in gguf.GGUFReader(path).tensors:
        name = gguf_tensor_name(tensor.name)
        if name is None:
            assert tensor.name == "rope_freqs.weight"
            continue
        expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        torch.testing.assert_close(state[name], expected.reshape(state[name].shape), atol=0, rtol=0)
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            quantized.append(name)
    wanted = ("experts.gate_up_proj", "experts.down_proj") if ref.config.enable_moe_block else (
        "embed_tokens_per_layer.weight", "per_layer_input_gate.weight")
    assert all(any(name.endswith(w) for name in quantized) for w in wanted), quantized


def _greedy_with_gaps(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    cache = model.new_cache(128)
    logits = model(torch.tensor(prompt), cache).logits[0]
    tokens, gaps = [], []
    for _ in range(n):
        top = logits.topk(2)
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        logits = model(torch.tensor([tokens[-1]]), cache).logits[0]
    return tokens, gaps


def test_llama_server_decodes_the_same_tokens(converted):
    """llama-server on the same GGUF picks the same greedy tokens, up to the first near tie (where float32
    summation order may decide): the tiny models' capped logits lie close together."""
    from dflash_agent.bench.cpu import llama_cpp_binary
    from dflash_agent.bench.servers import running_servers

    binary = llama_cpp_binary(None, "llama-server")
    if binary is None:
        pytest.skip("no llama-server build ($LLAMA_CPP_BIN)")
    _, gguf, _ = converted
    ours = build_model(open_checkpoint(gguf), "cpu", torch.float32, progress=False)
    for seed in range(20):  # a prompt whose greedy run keeps clear of near ties for a while
        prompt = torch.randint(5, VOCAB, (21,), generator=torch.Generator().manual_seed(seed)).tolist()
        tokens, gaps = _greedy_with_gaps(ours, prompt, 30)
        sure = next((i for i, gap in enumerate(gaps) if gap < 1e-3), len(gaps))
        if sure >= 12:
            break
    assert sure >= 12, "no prompt of 20 keeps clear of near ties for 12 tokens"
    command = [str(binary), "-m", str(gguf), "--port", "{port}", "-np", "1", "-c", "256", "-t", "2", "--no-webui"]
    with running_servers([("llama-server", command)]) as urls:
        body = {"prompt": prompt, "n_predict": 30, "temperature": 0, "cache_prompt": False, "return_tokens": True,
                "ignore_eos": True}
        theirs = httpx.post(f"{urls[0][1]}/completion", json=body, timeout=120).json()["tokens"]
    assert theirs[:sure] == tokens[:sure]


@pytest.mark.parametrize("repack_cpu", [False, True], ids=["packed", "repacked"])
def test_q8_0_stays_packed_and_decodes_as_dequantized(converted, repack_cpu):
    """Kept in their GGUF blocks (the experts as stacks, a token reading only its experts' blocks), or repacked
    for the CPU's C matmuls (each expert's matrix on its own): the logits are those of the same file dequantized at
    load."""
    from dflash_agent.engine.model.packed import PackedWeight

    ref, _, path = converted
    ckpt = open_checkpoint(path)
    exact = build_model(ckpt, "cpu", torch.float32, progress=False, packed=False)
    packed = build_model(ckpt, "cpu", torch.float32, progress=False, packed=True, repack_cpu=repack_cpu)
    # the C layers take the MoE file whole (its router in float, as the converter keeps it); the E2B-like file's
    # 16-wide per-layer inputs and 48-wide MLP stay in float (Q8_0 rows are multiples of 32), so it runs in torch
    runner = StepRunner.build(packed)
    assert (runner.cpu is not None) == (repack_cpu and ref.config.enable_moe_block)
    if ref.config.enable_moe_block:
        stack = packed.layers[0].experts.gate_up_proj
        assert isinstance(stack, PackedWeight) and stack.dim() == 3
        # repacked: each expert's matrix on its own for the CPU matmuls (a token runs only its experts)
        assert (stack.experts is not None and all(m.cpu is not None for m in stack.experts)) == repack_cpu
    ids = torch.randint(0, VOCAB, (21,))
    want = exact(ids, exact.new_cache(64), logits_at=torch.arange(21)).logits
    got = runner.forward(ids, runner.new_cache(64), logits_at=torch.arange(21)).logits
    # the C matmuls quantize activations to int16 per block of 32: a relative error near 1e-5 per product
    torch.testing.assert_close(got, want, atol=1e-3 if repack_cpu else 0, rtol=0)


def test_assistant_gguf_drafts_as_its_safetensors(tmp_path):
    """A Gemma 4 assistant (MTP drafter) as llama.cpp's converter writes it (gemma4-assistant): its draft steps are
    the safetensors checkpoint's read through the whole LM head (the converter drops an ordered embedding's
    clusters, and llama.cpp reads the head whole)."""
    from dflash_agent.engine.model.mtp import is_mtp_checkpoint, load_mtp_drafter

    _converter()
    save_reference("gemma4", tmp_path / "target")
    save_assistant("gemma4", tmp_path / "assistant")
    save_tokenizer(tmp_path / "assistant")
    gguf = convert(tmp_path / "assistant", tmp_path / "assistant.gguf", "f32")
    assert is_mtp_checkpoint(gguf)
    target = build_model(open_checkpoint(tmp_path / "target"), "cpu", torch.float32, progress=False)
    cpu = torch.device("cpu")
    from_gguf = load_mtp_drafter(gguf, target.config, cpu, torch.float32)
    reference = load_mtp_drafter(tmp_path / "assistant", target.config, cpu, torch.float32)
    reference.masked_embedding = None
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3))
    cache = target.new_cache(64)
    out = target(prompt, cache, capture=(target.config.num_layers - 1,))
    hidden = target.norm(out.captured[target.config.num_layers - 1][-1])
    embed = target.embed(out.logits[0].argmax()[None])[0]
    got, want = (drafter.step(embed, hidden, PROMPT_LEN, drafter.keys(cache)) for drafter in (from_gguf, reference))
    for a, b in zip(got, want, strict=True):  # the logits and the next step's hidden state
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_the_real_shape_writer_writes_the_converters_metadata(converted, tmp_path):
    """bench.real_shapes writes, for the config a converted file describes, the model keys llama.cpp's converter
    wrote into it, each with the converter's value."""
    import numpy as np

    from dflash_agent.bench.real_shapes import write_real_shape_gguf
    from dflash_agent.engine.formats.gguf import read_gguf

    _, path, _ = converted
    ours = tmp_path / "ours.gguf"
    write_real_shape_gguf(ours, open_checkpoint(path).config, weights=False)
    theirs, mine = read_gguf(path).fields, read_gguf(ours).fields
    keys = {k for k in theirs if k.startswith("gemma4.")}
    assert keys == {k for k in mine if k.startswith("gemma4.")}
    for key in sorted(keys):
        a, b = theirs[key], mine[key]
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            assert np.asarray(a).tolist() == np.asarray(b).tolist(), key
        else:
            assert a == pytest.approx(b), key

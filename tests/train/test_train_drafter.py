"""`dflash-agent train-drafter` at tiny scale: data generation against the engine's decoding, the
training forward against the engine's drafting, resumable training, and the trained checkpoint in
both our engine and z-lab's reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from dflash_agent.engine.decode.sampling import Sampler, SamplingParams
from dflash_agent.engine.decode.speculative import RequestDecoder, SpecConfig
from dflash_agent.engine.load.tokenizer import Tokenizer
from dflash_agent.engine.load.weights import build_model, open_checkpoint
from dflash_agent.engine.model.drafter import load_drafter
from dflash_agent.engine.runner import StepRunner
from dflash_agent.train.blocks import forward_blocks, sample_anchors
from dflash_agent.train.data import DataDir, DataError, DataSpec, checkpoint_bytes, corpus_files, prepare, prompts
from dflash_agent.train.evaluate import replay_acceptance
from dflash_agent.train.target import BatchGenerator
from dflash_agent.train.trainer import TargetParts, TrainConfig, Trainer, _write_checkpoint
from tests.engine.dflash_pair import BLOCK as PAIR_BLOCK
from tests.engine.dflash_pair import DRAFT_WINDOW, save_drafter
from tests.engine.dflash_pair import MASK_ID as PAIR_MASK_ID
from tests.helpers.decoding import decode, prefill
from tests.helpers.references import VOCAB, save_reference

from .tiny import MASK_ID, save_target, write_corpus

PROMPT, CONTINUATION, BLOCK = 12, 24, 4
LAYERS = (0, 2)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from threads, and lose much to a busy machine's scheduling."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, _one_thread):
    root = tmp_path_factory.mktemp("train")
    reference = save_target(root / "target")
    model = build_model(open_checkpoint(root / "target"), "cpu", torch.float32, progress=False)
    tokenizer = Tokenizer.from_dir(root / "target")
    corpus = write_corpus(root / "corpus")
    spec = DataSpec(target=str(root / "target"), target_bytes=checkpoint_bytes(root / "target"), layer_ids=LAYERS, prompt_tokens=PROMPT,
                    continuation_tokens=CONTINUATION, corpus=(str(corpus),), glob="*.py", seed=0)
    data = DataDir(root / "data", spec)
    prepare(data, {"train": 16, "eval": 4}, tokenizer,
            lambda: BatchGenerator(model, LAYERS, tokenizer.stop_ids), batch_size=8)
    return {"root": root, "reference": reference, "model": model, "tokenizer": tokenizer, "spec": spec, "data": data}


def _config(**overrides) -> TrainConfig:
    base = {"num_layers": 2, "block_size": BLOCK, "target_layer_ids": LAYERS, "anchors": 32, "batch": 4, "steps": 40,
            "lr": 3e-3, "warmup": 0.05, "negatives": 16}
    return TrainConfig(**{**base, **overrides})


def _trainer(tiny, out: Path, **overrides) -> Trainer:
    model, data = tiny["model"], tiny["data"]
    return Trainer(out, TargetParts.of(model), data.open("train"), _config(**overrides), MASK_ID,
                   data.spec.to_json(), torch.device("cpu"))


@pytest.fixture(scope="module")
def trained(tiny):
    trainer = _trainer(tiny, tiny["root"] / "drafter")
    trainer.run(save_every=20)
    return trainer


# --- the target's continuations ----------------------------------------------------------------


def _plain_greedy(model, prompt: list[int], length: int, stop: set[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding one token at a time through GemmaModel.forward, with the same capture."""
    cache = model.new_cache(64)
    tokens = list(prompt)
    out = model(torch.tensor(tokens), cache, capture=LAYERS)
    feats = [torch.cat([out.captured[i] for i in LAYERS], -1)]
    while len(tokens) < length and not (len(tokens) > len(prompt) and tokens[-1] in stop):
        tokens.append(int(out.logits[0].argmax()))
        out = model(torch.tensor(tokens[-1:]), cache, capture=LAYERS)
        feats.append(torch.cat([out.captured[i] for i in LAYERS], -1))
    return tokens, torch.cat(feats)


@pytest.mark.parametrize("kind", ["gemma3", "gemma4"])
def test_batch_generation_matches_engine_decoding(tmp_path, kind):
    save_reference(kind, tmp_path)
    model = build_model(open_checkpoint(tmp_path), "cpu", torch.float32, progress=False)
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(5, VOCAB, (11,), generator=gen).tolist() for _ in range(5)]
    new = 20  # 31 positions: past the target's sliding window of 8
    free = BatchGenerator(model, LAYERS, frozenset()).generate(batch, new)
    # A token row 0 generates early becomes a stop token: rows end there, others run on.
    stop = free[0].tokens[11 + 3]
    for prompt, got in zip(batch, BatchGenerator(model, LAYERS, frozenset({stop})).generate(batch, new)):
        tokens, features = _plain_greedy(model, prompt, 11 + new, {stop})
        assert got.tokens == tokens and got.prompt_len == 11
        torch.testing.assert_close(got.features, features, atol=1e-4, rtol=1e-4)
    assert len(free[0].tokens) == 31
    assert any(len(c.tokens) < 31 for c in BatchGenerator(model, LAYERS, frozenset({stop})).generate(batch, new))


def test_prompts_are_reproducible_and_eval_files_are_held_out(tiny):
    spec, tokenizer = tiny["spec"], tiny["tokenizer"]
    files = corpus_files(spec.corpus, spec.glob)
    held_out = {f.name for f in files if f.held_out}
    assert held_out and len(held_out) < len(files)
    first = prompts(files, "eval", tokenizer, PROMPT, seed=0)
    again = prompts(files, "eval", tokenizer, PROMPT, seed=0)
    a, b = [next(first) for _ in range(8)], [next(again) for _ in range(8)]
    assert a == b and all(len(p) == PROMPT and p[0] == tokenizer.bos_id for p in a)
    held_text = {(tiny["root"] / "corpus" / name).read_text() for name in held_out}
    for p in a:  # every eval prompt is a piece of a held-out file
        words = tokenizer.decode(p[1:])
        assert any(words in text for text in held_text)


def test_data_is_cached_and_reused(tiny, tmp_path):
    data, tokenizer, model = tiny["data"], tiny["tokenizer"], tiny["model"]
    assert data.count("train") == 16 and data.count("eval") == 4

    def must_not_load():
        raise AssertionError("the target ran although the cache holds every sequence")

    prepare(DataDir(data.path, data.spec), {"train": 16, "eval": 4}, tokenizer, must_not_load, batch_size=8)

    # A copy asked for more generates only what is missing, and keeps what it had.
    copy = DataDir(tmp_path / "data", data.spec)
    for shard in data.path.glob("train-*.safetensors"):
        (copy.path / shard.name).write_bytes(shard.read_bytes())
    generated: list[int] = []
    generator = BatchGenerator(model, LAYERS, tokenizer.stop_ids)
    real = generator.generate

    def counting(batch, new):
        generated.append(len(batch))
        return real(batch, new)

    generator.generate = counting
    prepare(copy, {"train": 20}, tokenizer, lambda: generator, batch_size=8)
    assert sum(generated) == 4 and copy.count("train") == 20
    old, new = data.open("train"), copy.open("train")
    for i in range(16):
        assert torch.equal(old.tokens(i), new.tokens(i))
    # Sequence 16 is the one a fresh 20-sequence run would have generated.
    fresh = DataDir(tmp_path / "fresh", data.spec)
    prepare(fresh, {"train": 20}, tokenizer, lambda: BatchGenerator(model, LAYERS, tokenizer.stop_ids), batch_size=20)
    assert torch.equal(fresh.open("train").tokens(17), new.tokens(17))
    seq = new[17]
    assert seq.features.shape == (len(seq.tokens), len(LAYERS) * 64) and seq.features.dtype == torch.bfloat16

    other = DataSpec(**{**data.spec.__dict__, "prompt_tokens": PROMPT + 1})
    with pytest.raises(DataError, match="prompt_tokens=12, not 13"):
        DataDir(data.path, other)


# --- the training forward ------------------------------------------------------------------------


@pytest.mark.parametrize("bounded", [False, True], ids=["whole context", "draft-ctx"])
def test_training_forward_matches_inference_drafting(tmp_path, bounded):
    """All blocks in one pass give, row for row, what Drafter.draft gives for each block alone:
    context strictly before the anchor, the drafter's sliding window (12, shorter than the context),
    causal sliding layers, a bidirectional full layer (bounded too: --draft-ctx), and no block seeing another."""
    save_drafter(tmp_path)
    drafter = load_drafter(tmp_path, 64, 4, VOCAB, torch.device("cpu"), torch.float32)
    if bounded:
        drafter = drafter.with_context_window(DRAFT_WINDOW + 6)
    length = 40
    features = torch.randn(length, 2 * 64)
    embed = torch.randn(VOCAB, 64)
    tokens = torch.randint(5, VOCAB, (length,))
    anchors = sample_anchors(length, 10, 8, torch.Generator().manual_seed(0))
    assert int(anchors.max()) > DRAFT_WINDOW
    ids = torch.full((len(anchors), PAIR_BLOCK), PAIR_MASK_ID)
    ids[:, 0] = tokens[anchors]
    together = forward_blocks(drafter, features, embed[ids.reshape(-1)], anchors).view(len(anchors), PAIR_BLOCK, -1)
    for anchor, block_ids, got in zip(anchors.tolist(), ids, together):
        cache = drafter.new_cache(64)
        drafter.append_context(features[:anchor], cache)
        torch.testing.assert_close(got, drafter.draft(embed[block_ids], cache), atol=1e-5, rtol=1e-5)


def test_anchors_leave_the_prompt_to_the_prefill():
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(30, 12, 100, gen)
    assert anchors.tolist() == list(range(12, 29))  # every generated token that has a label after it
    assert sample_anchors(13, 12, 4, gen).numel() == 0


# --- training --------------------------------------------------------------------------------------


def test_training_reduces_the_loss(trained):
    losses = [s.loss for s in trained.history.steps]
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, losses
    blocks = [s.block_acceptance for s in trained.history.steps]
    assert sum(blocks[-5:]) / 5 > sum(blocks[:5]) / 5


def test_resume_repeats_the_uninterrupted_run(tiny, tmp_path):
    whole = _trainer(tiny, tmp_path / "whole", steps=6)
    whole.run(save_every=2)
    part = _trainer(tiny, tmp_path / "parts", steps=6)
    part.run(until=3, save_every=2)
    assert part.step == 3
    resumed = _trainer(tiny, tmp_path / "parts", steps=6)
    assert resumed.step == 3
    resumed.run(save_every=2)
    assert [s.loss for s in resumed.history.steps] == [s.loss for s in whole.history.steps]
    a, b = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(tmp_path / "parts" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="block_size=4, not 8"):
        _trainer(tiny, tmp_path / "parts", steps=6, block_size=8)


def test_checkpoint_runs_on_raw_features(tiny, trained, tmp_path):
    """Training sees the features divided by their per-channel RMS; the written weights fold that
    into fc, so on the target's raw features the checkpoint computes what the trainer computed."""
    scale = trained.feature_scale
    assert float(scale.max() / scale.min()) > 2  # the tiny target's channels differ: the fold matters
    seq = tiny["data"].open("train")[0]
    scaled = seq.features.float() * scale
    assert torch.allclose(scaled.pow(2).mean(0).mean(), torch.tensor(1.0), rtol=0.5)
    _write_checkpoint(tmp_path, trained.raw, trained.weights(), dtype=torch.float32)
    written = load_drafter(tmp_path, 64, 4, VOCAB, torch.device("cpu"), torch.float32)
    anchors = sample_anchors(len(seq.tokens), seq.prompt_len, 8, torch.Generator().manual_seed(0))
    ids = torch.full((len(anchors), BLOCK), MASK_ID)
    ids[:, 0] = seq.tokens[anchors]
    embeds = tiny["model"].embed_tokens.weight[ids.reshape(-1)]
    with torch.no_grad():
        want = forward_blocks(trained.drafter, scaled, embeds, anchors)
        got = forward_blocks(written, seq.features.float(), embeds, anchors)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _decode(model, drafter, prompt, max_new):
    decoder = RequestDecoder(StepRunner(model), model.new_cache(128), Sampler(SamplingParams()), drafter=drafter,
                             drafter_cache=drafter.new_cache(128), spec=SpecConfig(block=BLOCK, ngram=False))
    prefill(decoder, prompt)
    return list(decode(decoder, max_new)), decoder.stats


def test_replayed_acceptance_equals_engine_decoding(tiny, trained):
    model, eval_set = tiny["model"], tiny["data"].open("eval")
    drafter = load_drafter(trained.out, 64, 4, VOCAB, torch.device("cpu"), torch.float32)
    replay = replay_acceptance(drafter, model.embed_tokens.weight, model.output_weight, eval_set)
    steps = committed = 0
    for i in range(len(eval_set)):
        tokens, P = eval_set.tokens(i).tolist(), eval_set.prompt_len(i)
        out, stats = _decode(model, drafter, tokens[:P], len(tokens) - P)
        assert out == tokens[P:]
        steps += stats.steps
        committed += stats.steps + stats.accepted
    assert (replay.steps, replay.committed) == (steps, committed)
    assert committed > steps  # some drafts were accepted, so the comparison means something


def test_checkpoint_gives_same_ids_in_zlab_reference(tiny, trained, monkeypatch):
    dflash_model = pytest.importorskip("dflash.model")
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    reference = dflash_model.DFlashDraftModel.from_pretrained(trained.out, dtype=torch.float32).eval()
    assert reference.block_size == BLOCK and reference.mask_token_id == MASK_ID
    ours = load_drafter(trained.out, 64, 4, VOCAB, torch.device("cpu"), torch.float32)
    model, eval_set = tiny["model"], tiny["data"].open("eval")
    accepted = 0
    for i in range(len(eval_set)):
        tokens, P = eval_set.tokens(i).tolist(), eval_set.prompt_len(i)
        ref = dflash_model.dflash_generate(reference, tiny["reference"], torch.tensor([tokens[:P]]), CONTINUATION,
                                           None, temperature=0.0, return_stats=True)
        out, stats = _decode(model, ours, tokens[:P], CONTINUATION)
        assert out == ref.output_ids[0, P:].tolist()
        assert [a + 1 for a in stats.accept_lengths][:-1] == ref.acceptance_lengths[: len(stats.accept_lengths) - 1]
        accepted += stats.accepted
    assert accepted > 0


# --- the command ---------------------------------------------------------------------------------


def test_train_drafter_command(tiny, tmp_path):
    from dflash_agent.cli import main

    args = ["train-drafter", "--target", str(tiny["root"] / "target"), "--out", str(tmp_path / "out"),
            "--corpus", str(tiny["root"] / "corpus"), "--data", str(tiny["data"].path), "--sequences", "16",
            "--eval-sequences", "2", "--prompt-tokens", str(PROMPT), "--continuation-tokens", str(CONTINUATION),
            "--layers", "2", "--target-layers", "0,2", "--block-size", str(BLOCK), "--steps", "4", "--save-every", "2",
            "--device", "cpu"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["step"] == summary["steps"] == 4
    assert [s for s, _ in summary["evals"]] == [4]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["block_size"] == BLOCK and config["dflash_config"]["target_layer_ids"] == [0, 2]
    assert config["dflash_config"]["input_embedding_scale"] == pytest.approx(8.0)  # sqrt(hidden 64)
    load_drafter(tmp_path / "out", 64, 4, VOCAB, torch.device("cpu"), torch.float32)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_agent", "train-drafter", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})


@pytest.mark.parametrize("case", ["missing target", "unwritable out", "empty corpus"])
def test_bad_input_is_one_line(tiny, tmp_path, case):
    target, out, corpus = str(tiny["root"] / "target"), tmp_path / "out", tiny["root"] / "corpus"
    if case == "missing target":
        target, expected = str(tmp_path / "nowhere.gguf"), "model not found"
    elif case == "unwritable out":
        (tmp_path / "file").write_text("")
        out, expected = tmp_path / "file" / "out", "cannot write to"
    else:
        corpus, expected = tmp_path / "empty", "no files matching '*.py'"
        corpus.mkdir()
    proc = _cli("--target", target, "--out", str(out), "--corpus", str(corpus), "--device", "cpu")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr

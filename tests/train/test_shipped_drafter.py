"""The DFlash drafter shipped for the embedded Gemma 3 270M (dflash_agent/engine/drafters/gemma3-270m).

It is what `generate` speculates with when no drafter is named, it keeps greedy output exactly the
target's, its drafts are accepted on held-out code (files the training never saw), and z-lab's
reference, reading the same checkpoint, gives the same ids and acceptance lengths.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time

import pytest
import torch
from click.testing import CliRunner

from dflash_agent.engine.decode.speculative import SpecConfig
from dflash_agent.engine.engine import Engine, FinalEvent, GenerateRequest
from dflash_agent.engine.load.weights import EMBEDDED_DRAFTER, default_drafter
from dflash_agent.train.data import CorpusFile

# The goal is a mean acceptance of 3 over the training's 32 held-out sequences (not reached yet:
# the bundled drafter is an interim one at 1.53, see README); an untrained drafter commits 1.0 per step.
FLOOR = 1.2
NEW_TOKENS = 96

pytestmark = pytest.mark.skipif(default_drafter("embedded") is None, reason="no drafter bundled")


def held_out_prompts(tokenizer) -> list[list[int]]:
    """256-token cuts of standard-library modules that the training's data split keeps out."""
    import calendar
    import json.decoder
    import shutil

    prompts = []
    for module, name, start in ((json.decoder, "json/decoder.py", 0), (shutil, "shutil.py", 2000),
                                (calendar, "calendar.py", 1500)):
        assert CorpusFile(None, name).held_out, name  # never a training prompt
        ids = tokenizer.encode(inspect.getsource(module), add_bos=False)
        prompts.append([tokenizer.bos_id] + ids[start : start + 255])
    return prompts


@pytest.fixture(scope="module")
def engines(embedded_engine):
    # A fixed draft length (the drafter's block): the adaptive controller's choices depend on timing.
    block = json.loads((EMBEDDED_DRAFTER / "config.json").read_text())["block_size"]
    spec = embedded_engine(1024, spec=SpecConfig(block=block, ngram=False), device="cpu", dtype="float32")
    plain = Engine(spec.model, spec.tokenizer, spec.n_ctx, spec.model_name, spec=SpecConfig(enabled=False),
                   runner=spec.runner)
    yield spec, plain
    spec.close()
    plain.close()


def _final(engine: Engine, prompt: list[int]) -> tuple[list[int], FinalEvent]:
    async def collect():
        ids = []
        async for event in engine.generate(GenerateRequest(prompt, max_tokens=NEW_TOKENS)):
            if isinstance(event, FinalEvent):
                return ids, event
            ids.extend(event.ids)
        raise AssertionError("no final event")

    return asyncio.run(collect())


def test_bundled_drafter_is_small_and_the_embedded_default():
    size = sum(p.stat().st_size for p in EMBEDDED_DRAFTER.iterdir())
    assert size <= 50 * 2**20
    assert default_drafter("embedded") == EMBEDDED_DRAFTER
    assert default_drafter("some/other-model") is None


def test_drafts_are_accepted_on_held_out_code_and_output_is_exact(engines):
    spec, plain = engines
    assert spec.drafter is not None  # loaded without being named
    committed = steps = 0
    for prompt in held_out_prompts(spec.tokenizer):
        ids, final = _final(spec, prompt)
        assert ids == _final(plain, prompt)[0]
        assert final.spec.by_source.keys() == {"dflash"}
        committed += final.spec.steps + final.spec.accepted
        steps += final.spec.steps
    assert committed / steps >= FLOOR


def test_generate_speculates_by_default_and_no_spec_turns_it_off():
    from dflash_agent.cli import main

    runner = CliRunner()
    prompt = "def parse_args(argv):\n    parser = argparse.ArgumentParser("
    default = runner.invoke(main, ["generate", prompt, "-n", "24", "--json", "--device", "cpu"])
    off = runner.invoke(main, ["generate", prompt, "-n", "24", "--json", "--device", "cpu", "--no-spec"])
    assert default.exit_code == 0 and off.exit_code == 0, default.output + off.output
    default, off = json.loads(default.stdout), json.loads(off.stdout)
    assert default["stats"]["draft_model"] is True and off["stats"]["draft_model"] is False
    assert off["stats"]["spec_steps"] == 0
    assert default["token_ids"] == off["token_ids"]


def test_zlab_reference_gives_the_same_ids(engines, embedded_gguf, monkeypatch):
    dflash_model = pytest.importorskip("dflash.model")
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    reference = dflash_model.DFlashDraftModel.from_pretrained(EMBEDDED_DRAFTER, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(embedded_gguf.parent, gguf_file=embedded_gguf.name,
                                                  dtype=torch.float32).eval()
    spec, _ = engines
    prompt = held_out_prompts(spec.tokenizer)[0]
    ids, final = _final(spec, prompt)
    with torch.no_grad():
        ref = dflash_model.dflash_generate(reference, target, torch.tensor([prompt]), NEW_TOKENS, None,
                                           temperature=0.0, return_stats=True)
    assert ids == ref.output_ids[0, len(prompt):].tolist()
    lengths = [a + 1 for a in final.spec.accept_lengths]
    # z-lab's last step may be cut by max_new_tokens differently; every earlier step must agree.
    assert lengths[:-1] == ref.acceptance_lengths[: len(lengths) - 1]

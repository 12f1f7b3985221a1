"""Gemma 4 assistant (MTP) drafters against transformers' Gemma4AssistantForCausalLM and its candidate generator's
loop, on tiny random checkpoints; and speculation with them, lossless."""

import pytest
import torch

from dflash_agent.engine.load.weights import build_model, open_checkpoint
from dflash_agent.engine.model.mtp import is_mtp_checkpoint, load_mtp_drafter
from tests.helpers.references import PROMPT_LEN, VOCAB, save_assistant, save_reference
from tests.helpers.tokenizers import word_tokenizer


@pytest.fixture(params=["gemma4", "ple"])
def setup(request, tmp_path):
    target_ref = save_reference(request.param, tmp_path / "target")
    assistant_ref = save_assistant(request.param, tmp_path / "assistant")
    target = build_model(open_checkpoint(tmp_path / "target"), "cpu", torch.float32, progress=False)
    assert is_mtp_checkpoint(tmp_path / "assistant") and not is_mtp_checkpoint(tmp_path / "target")
    mtp = load_mtp_drafter(tmp_path / "assistant", target.config, torch.device("cpu"), torch.float32)
    return target_ref, assistant_ref, target, mtp


def test_draft_steps_match_transformers_candidate_loop(setup):
    """After a prompt past the window: the logits of 5 draft steps, each fed the last drafted token and the
    assistant's projected state, as transformers' Gemma4AssistantCandidateGenerator runs them."""
    target_ref, assistant_ref, target, mtp = setup
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = target_ref.model(prompt[None], output_hidden_states=True, return_shared_kv_states=True)
        anchor = int(target_ref.lm_head(out.last_hidden_state[0, -1]).argmax())
        hidden, token, expected = out.hidden_states[-1][:, -1:], torch.tensor([[anchor]]), []
        for _ in range(5):
            embeds = torch.cat([target_ref.model.embed_tokens(token), hidden], dim=-1)
            step = assistant_ref(inputs_embeds=embeds, position_ids=torch.tensor([[PROMPT_LEN]]),
                                 shared_kv_states=out.shared_kv_states)
            expected.append(step.logits[0, -1])
            token, hidden = step.logits.argmax(-1), step.last_hidden_state
    cache = target.new_cache(64)
    ours = target(prompt, cache, capture=(mtp.target_layer,))
    assert int(ours.logits[0].argmax()) == anchor
    hidden, token, keys = target.norm(ours.captured[mtp.target_layer][-1]), anchor, mtp.keys(cache)
    for want in expected:
        logits, hidden = mtp.step(target.embed(torch.tensor([token]))[0], hidden, PROMPT_LEN, keys)
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
        token = int(logits.argmax())


def _run(engine, prompt: list[int], max_tokens: int):
    import asyncio

    from dflash_agent.engine.engine import GenerateRequest

    async def collect():
        return [e async for e in engine.generate(GenerateRequest(prompt, max_tokens=max_tokens))]

    events = asyncio.run(collect())
    return [t for e in events[:-1] for t in e.ids], events[-1]


@pytest.mark.parametrize("block", [None, 4], ids=["adaptive", "fixed"])
def test_speculation_with_the_assistant_is_lossless(setup, block):
    """Agent turns through the prefix cache, the assistant drafting (a fixed block: every step; adaptive: as the
    controller finds it pays): each turn's greedy tokens are plain decoding's, and the drafts are counted as mtp's.
    The last turn's prompt is wholly cached: its first step has no target row to draft from, and decodes plainly."""
    from dflash_agent.engine.cache.prefix_cache import PrefixCacheConfig
    from dflash_agent.engine.decode.speculative import SpecConfig
    from dflash_agent.engine.engine import Engine

    _, _, target, mtp = setup
    fast = Engine(target, word_tokenizer(VOCAB), 256, drafter=mtp, spec=SpecConfig(block=block, ngram=False),
                  prefix_cache=PrefixCacheConfig(min_tokens=8))
    plain = Engine(target, word_tokenizer(VOCAB), 256, spec=SpecConfig(enabled=False), prefix_cache=None)
    try:
        convo = torch.randint(5, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(4)).tolist()
        drafted = 0
        for turn in range(3):
            ids, final = _run(fast, convo, 16)
            assert ids == _run(plain, convo, 16)[0]
            drafted += final.spec.drafted
            assert set(final.spec.by_source) <= {"mtp"}
            if turn == 2:
                assert final.timings.cache_n == len(convo)  # the repeated prompt, wholly from the cache
            elif turn == 0:
                convo = convo + ids + [7, 8, 9]
        if block is not None:
            assert drafted > 0
    finally:
        fast.close()
        plain.close()


def test_an_assistant_for_another_target_is_refused(tmp_path):
    from dataclasses import replace

    from dflash_agent.engine.errors import DrafterError

    save_assistant("gemma4", tmp_path / "assistant")
    save_reference("ple", tmp_path / "ple")
    ple = open_checkpoint(tmp_path / "ple").config  # full layers of 1 K / V head, sliding ones of 1: not 2
    with pytest.raises(DrafterError, match="sliding layers read 2 K / V heads of 16, the target's layer 1 holds 1"):
        load_mtp_drafter(tmp_path / "assistant", ple, torch.device("cpu"), torch.float32)
    with pytest.raises(DrafterError, match="trained for a 64-wide target; this one is 96 wide"):
        load_mtp_drafter(tmp_path / "assistant", replace(ple, hidden_size=96), torch.device("cpu"), torch.float32)

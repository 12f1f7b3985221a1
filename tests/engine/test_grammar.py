"""Token-level grammar matching with xgrammar, on the embedded Gemma 3 tokenizer (262k ids)."""

import json
import random

import pytest
import torch

from dflash_agent.engine.decode.grammar import GrammarCompiler, GrammarError

VOCAB = 262144
SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "limit": {"type": "integer"},
        "mode": {"enum": ["read", "write"]},
    },
    "required": ["path"],
}
VALID = '{"path": "src/main.py", "limit": 20, "mode": "read"}'


@pytest.fixture(scope="module")
def tokenizer(gemma3_tokenizer):
    return gemma3_tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB)


@pytest.fixture(scope="module")
def grammar(compiler):
    return compiler.json_schema(SCHEMA)


def allowed(matcher, vocab=VOCAB):
    logits = torch.zeros(vocab)
    matcher.mask(logits)
    return torch.isfinite(logits)


def feed(matcher, ids):
    for token in ids:
        assert allowed(matcher)[token], token
        assert matcher.accept(token), token


def test_valid_json_is_accepted_then_only_stop_tokens(grammar, tokenizer):
    matcher = grammar.matcher()
    feed(matcher, tokenizer.encode(VALID, add_bos=False))
    assert not matcher.is_terminated
    assert set(allowed(matcher).nonzero().flatten().tolist()) == set(tokenizer.stop_ids)
    assert not matcher.accept(tokenizer.encode(" ", add_bos=False)[0])
    assert matcher.accept(tokenizer.eos_id)
    assert matcher.is_terminated
    # Terminated: nothing but the stop tokens, and nothing more is accepted.
    assert set(allowed(matcher).nonzero().flatten().tolist()) == set(tokenizer.stop_ids)
    assert not matcher.accept(tokenizer.eos_id)


def test_refused_token_leaves_the_state_alone(grammar, tokenizer):
    matcher = grammar.matcher()
    ids = tokenizer.encode(VALID, add_bos=False)
    feed(matcher, ids[:3])
    before = allowed(matcher)
    bad = tokenizer.encode("}", add_bos=False)[0]
    assert not before[bad]
    assert not matcher.accept(bad)
    assert torch.equal(allowed(matcher), before)
    feed(matcher, ids[3:])


def test_accept_without_mask_checks_the_grammar(grammar, tokenizer):
    matcher = grammar.matcher()
    assert not matcher.accept(tokenizer.encode("[", add_bos=False)[0])
    for token in tokenizer.encode(VALID, add_bos=False):
        assert matcher.accept(token)
    assert not matcher.accept(-1) and not matcher.accept(VOCAB)


def test_stop_token_refused_before_completion(grammar, tokenizer):
    matcher = grammar.matcher()
    feed(matcher, tokenizer.encode('{"path": "a"', add_bos=False))
    assert not allowed(matcher)[tokenizer.eos_id]
    assert not matcher.accept(tokenizer.eos_id)
    assert not matcher.is_terminated


def test_special_tokens_never_appear_inside_text(grammar, tokenizer):
    matcher = grammar.matcher()
    feed(matcher, tokenizer.encode('{"path": "a', add_bos=False))
    mask = allowed(matcher)
    assert mask[tokenizer.encode("b", add_bos=False)[0]]
    for special in tokenizer.special_ids:
        assert not mask[special], tokenizer.id_to_piece(special)


@pytest.mark.parametrize("seed", range(4))
def test_rollback_matches_a_fresh_matcher(grammar, tokenizer, seed):
    """Speculative verification: accept a drafted block token by token, stop at the first token
    the grammar refuses, roll back the rejected tail; masks equal a matcher fed the kept prefix."""
    rng = random.Random(seed)
    ids = tokenizer.encode(VALID, add_bos=False)
    matcher = grammar.matcher(max_rollback=8)
    start = rng.randrange(0, 6)
    feed(matcher, ids[:start])
    draft = ids[start : start + 6]
    if seed % 2:  # a draft that goes wrong midway
        draft[3] = tokenizer.bos_id  # never allowed
    accepted = 0
    for token in draft:
        allowed(matcher)
        if not matcher.accept(token):
            break
        accepted += 1
    assert accepted == (3 if seed % 2 else len(draft))
    keep = rng.randrange(0, accepted + 1)
    matcher.rollback(accepted - keep)
    fresh = grammar.matcher()
    feed(fresh, ids[: start + keep])
    assert torch.equal(allowed(matcher), allowed(fresh))
    # Both carry on identically to the end.
    feed(matcher, ids[start + keep :])
    assert matcher.accept(tokenizer.eos_id) and matcher.is_terminated


@pytest.mark.parametrize("seed", range(3))
def test_random_accepts_and_rollbacks_match_a_replay(grammar, tokenizer, seed):
    """Masks stay right through any mix of accepts and rollbacks, branches included."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    matcher, accepted = grammar.matcher(max_rollback=6), []
    for _ in range(40):
        mask = allowed(matcher)
        fresh = grammar.matcher()
        for token in accepted:
            assert fresh.accept(token)
        assert torch.equal(mask, allowed(fresh))
        if accepted and rng.random() < 0.3:
            n = rng.randint(1, min(len(accepted), 3))
            matcher.rollback(n)
            del accepted[-n:]
            continue
        choices = mask.nonzero().flatten()
        token = int(choices[torch.randint(len(choices), (1,), generator=gen)])
        if token in tokenizer.stop_ids:
            continue
        assert matcher.accept(token)
        accepted.append(token)


def test_a_verified_draft_reuses_its_masks(grammar, tokenizer):
    class CountingFills:
        def __init__(self, inner):
            self.inner, self.fills = inner, 0

        def fill_next_token_bitmask(self, bitmask):
            self.fills += 1
            return self.inner.fill_next_token_bitmask(bitmask)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    ids = tokenizer.encode(VALID, add_bos=False)
    matcher = grammar.matcher()
    counter = matcher._matcher = CountingFills(matcher._matcher)
    for token in ids[:8]:  # drafting
        allowed(matcher)
        assert matcher.accept(token)
    matcher.rollback(8)
    assert counter.fills == 8
    for token in ids[:5]:  # verification keeps five
        allowed(matcher)
        assert matcher.accept(token)
    assert counter.fills == 8
    # A sixth token other than the drafted one starts a new branch: its next mask is filled anew.
    other = next(t for t in allowed(matcher).nonzero().flatten().tolist() if t != ids[5])
    assert matcher.accept(other)
    fresh = grammar.matcher()
    for token in [*ids[:5], other]:
        assert fresh.accept(token)
    assert torch.equal(allowed(matcher), allowed(fresh))
    assert counter.fills == 9


def test_rollback_of_a_stop_token(grammar, tokenizer):
    matcher = grammar.matcher()
    feed(matcher, tokenizer.encode(VALID, add_bos=False))
    assert matcher.accept(tokenizer.eos_id)
    matcher.rollback(2)
    assert not matcher.is_terminated
    feed(matcher, tokenizer.encode(VALID, add_bos=False)[-1:])


def test_rollback_limits(grammar, tokenizer):
    ids = tokenizer.encode(VALID, add_bos=False)
    matcher = grammar.matcher(max_rollback=3)
    with pytest.raises(ValueError, match="roll back 1"):
        matcher.rollback(1)
    feed(matcher, ids[:5])
    with pytest.raises(ValueError, match="3 can be rolled back"):
        matcher.rollback(4)
    matcher.rollback(3)
    with pytest.raises(ValueError):
        matcher.rollback(-1)
    with pytest.raises(ValueError):
        grammar.matcher(max_rollback=-1)


def test_mask_shapes_and_dtypes(grammar):
    reference = allowed(grammar.matcher())
    for logits in (torch.zeros(1, VOCAB), torch.zeros(VOCAB, dtype=torch.bfloat16), torch.randn(1, VOCAB)):
        grammar.matcher().mask(logits)
        assert torch.equal(torch.isfinite(logits.float()).flatten(), reference)
    for shape in ((VOCAB - 1,), (2, VOCAB), (1, 1, VOCAB)):
        with pytest.raises(ValueError, match="logits of shape"):
            grammar.matcher().mask(torch.zeros(shape))


def test_model_vocabulary_wider_than_the_tokenizer(tokenizer):
    wide = GrammarCompiler(tokenizer, VOCAB + 64).json_object()
    mask = allowed(wide.matcher(), VOCAB + 64)
    assert mask[tokenizer.encode("{", add_bos=False)[0]]
    assert not mask[VOCAB:].any()


def test_named_special_token(compiler, tokenizer):
    turn = compiler.token_id("<start_of_turn>")
    grammar = compiler.ebnf(f'root ::= Token({turn}) "model" [^<]*', tokens=[turn])
    matcher = grammar.matcher()
    mask = allowed(matcher)
    assert mask.nonzero().flatten().tolist() == [turn]
    assert matcher.accept(turn)
    feed(matcher, tokenizer.encode("model\nhello", add_bos=False))
    mask = allowed(matcher)
    # The named token is matched as a token only; other special tokens stay out of the text.
    assert not mask[turn] and not mask[tokenizer.bos_id]
    assert mask[tokenizer.encode(" world", add_bos=False)[0]]
    assert all(mask[i] for i in tokenizer.stop_ids)  # [^<]* may end anywhere


def test_json_object(compiler, tokenizer):
    grammar = compiler.json_object()
    matcher = grammar.matcher()
    feed(matcher, tokenizer.encode('{"a": [1, {"b": null}]}', add_bos=False))
    assert matcher.accept(tokenizer.eos_id)
    assert not grammar.matcher().accept(tokenizer.encode("[", add_bos=False)[0])


def test_compiled_grammars_are_cached(compiler):
    assert compiler.json_schema(SCHEMA) is compiler.json_schema(json.loads(json.dumps(SCHEMA)))
    assert compiler.json_schema(SCHEMA) is not compiler.json_schema(SCHEMA, strict=False)
    assert compiler.ebnf('root ::= "x"') is compiler.ebnf('root ::= "x"')


def test_extra_stop_ids(tokenizer):
    newline = tokenizer.encode("\n", add_bos=False)[0]
    compiler = GrammarCompiler(tokenizer, VOCAB, extra_stop_ids=[newline])
    assert compiler.stop_ids == tokenizer.stop_ids | {newline}
    matcher = compiler.ebnf('root ::= "ok"').matcher()
    feed(matcher, tokenizer.encode("ok", add_bos=False))
    assert set(allowed(matcher).nonzero().flatten().tolist()) == tokenizer.stop_ids | {newline}
    with pytest.raises(ValueError, match="outside the vocabulary"):
        GrammarCompiler(tokenizer, VOCAB, extra_stop_ids=[VOCAB])


def test_errors_name_the_problem(compiler):
    with pytest.raises(GrammarError, match="invalid JSON schema: .*nonsense"):
        compiler.json_schema({"type": "nonsense"})
    with pytest.raises(GrammarError, match="not serializable"):
        compiler.json_schema({"type": "object", "default": object()})
    with pytest.raises(GrammarError, match='invalid EBNF.*"missing" is not defined'):
        compiler.ebnf("root ::= missing")
    with pytest.raises(GrammarError, match="not a single token"):
        compiler.token_id("<no such token>")
    with pytest.raises(GrammarError, match="outside the vocabulary"):
        compiler.ebnf('root ::= "x"', tokens=[VOCAB])
    assert issubclass(GrammarError, ValueError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_get_the_same_mask(grammar, tokenizer):
    ids = tokenizer.encode(VALID, add_bos=False)
    on_cpu, on_gpu = grammar.matcher(), grammar.matcher()
    for token in ids:
        cpu_logits, gpu_logits = torch.zeros(VOCAB), torch.zeros(1, VOCAB, device="cuda")
        on_cpu.mask(cpu_logits)
        on_gpu.mask(gpu_logits)
        assert torch.equal(torch.isfinite(gpu_logits[0]).cpu(), torch.isfinite(cpu_logits))
        assert on_cpu.accept(token) and on_gpu.accept(token)

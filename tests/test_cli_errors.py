"""How a command fails: a user's mistake (a UserError, or an OSError from a path they gave) is one line on stderr
and exit 1; anything else is a bug and prints its traceback and a line asking to report it."""

import logging

import pytest
from click.testing import CliRunner

import dflash_agent.cli as cli
from dflash_agent import engine
from dflash_agent.chat.types import ChatError
from dflash_agent.errors import UserError
from dflash_agent.options import INTERRUPTED, close_engine, report_error
from dflash_agent.train.data import DataError
from dflash_agent.train.trainer import TrainError


@pytest.fixture(autouse=True)
def _not_verbose():
    # `--verbose` (root at DEBUG) shows user errors' tracebacks too; these tests are about the default.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)
    yield
    root.setLevel(level)


def generate_failing_with(monkeypatch, exc: BaseException):
    def load_engine(*args, **kwargs):
        raise exc

    monkeypatch.setattr(cli, "load_engine", load_engine)
    return CliRunner().invoke(cli.main, ["generate", "hello"])


@pytest.mark.parametrize("exc", [
    engine.ModelLoadError("cannot read /models/x.gguf: not a GGUF file"),
    engine.OptionError("--device cuda was asked for but no CUDA GPU is available"),
    FileNotFoundError(2, "No such file or directory", "/models/x.gguf"),
])
def test_a_user_error_is_one_line_and_exit_1(monkeypatch, exc):
    result = generate_failing_with(monkeypatch, exc)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [f"error: {exc}"]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("exc", [
    RuntimeError("the worker thread died"),
    ValueError("not enough values to unpack (expected 2, got 1)"),  # a bug's ValueError is not a user error
    KeyError("n_ctx"),
])
def test_a_bug_prints_its_traceback_and_asks_for_a_report(monkeypatch, exc):
    result = generate_failing_with(monkeypatch, exc)
    assert result.exit_code == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert f"{type(exc).__name__}: " in result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("error: this is a bug in dflash-agent") and "report it" in last


def test_ctrl_c_while_loading_exits_130(monkeypatch):
    result = generate_failing_with(monkeypatch, KeyboardInterrupt())
    assert result.exit_code == INTERRUPTED and result.stderr == "interrupted\n"


class StepInFlight:
    """An engine whose worker is inside a long step: Engine.close(timeout) says False until the step has ended,
    at the `done_at`-th wait; Ctrl-C comes during the `ctrl_c_at`-th."""

    def __init__(self, done_at: int, ctrl_c_at: int | None = None) -> None:
        self.done_at, self.ctrl_c_at = done_at, ctrl_c_at
        self.waits: list[float | None] = []

    def close(self, timeout=None):
        self.waits.append(timeout)
        if len(self.waits) == self.ctrl_c_at:
            raise KeyboardInterrupt
        return len(self.waits) >= self.done_at


def test_closing_an_engine_waits_for_its_step_and_says_so(capsys):
    close_engine(slow := StepInFlight(done_at=2))
    assert slow.waits == [1.0, None]
    assert "waiting for the model to finish its current step" in capsys.readouterr().err
    close_engine(quick := StepInFlight(done_at=1))
    assert quick.waits == [1.0] and capsys.readouterr().err == ""


def test_ctrl_c_again_while_the_step_runs_ends_the_process_at_once(monkeypatch):
    # os._exit: the interpreter's own exit would finalize torch under the running step (SIGABRT)
    def exit_now(code):
        raise SystemExit(("os._exit", code))

    monkeypatch.setattr("os._exit", exit_now)
    for ctrl_c_at in (1, 2):  # within the first second's wait, or after the message
        with pytest.raises(SystemExit) as ended:
            close_engine(StepInFlight(done_at=3, ctrl_c_at=ctrl_c_at))
        assert ended.value.code == ("os._exit", INTERRUPTED)


@pytest.mark.parametrize("spec_option", [["--spec-block", "4"], ["--draft-ctx", "4096"]])
@pytest.mark.parametrize("command", [["generate", "hello"], ["serve", "--port", "0"], ["mcp", "--local", "--repo", "."],
                                     ["run", "a task"]])
def test_click_usage_errors_stay_clicks(command, spec_option):
    # serve and mcp load the model in the background: the mistake is still told at once, as a usage error.
    result = CliRunner().invoke(cli.main, [*command, "--no-spec", *spec_option])
    assert result.exit_code == 2, result.output
    assert "--no-spec cannot be combined" in result.stderr and "Traceback" not in result.stderr


def test_every_command_reports_errors_the_same_way():
    ctx = cli.main.make_context("dflash-agent", ["generate", "x"], resilient_parsing=True)
    names = cli.main.list_commands(ctx)
    assert {"generate", "prompt", "serve", "run", "chat", "mcp", "bench", "train-drafter"} <= set(names)
    bare = [name for name in names if not getattr(cli.main.get_command(ctx, name).callback, "reports_errors", False)]
    assert bare == []


def test_report_error_on_a_background_failure(capsys):
    # `serve` and `mcp` load the model in the background and report its failure through report_error.
    report_error(engine.MemoryPlanError("the largest context that fits is 4096 tokens (--ctx-size 4096)"))
    assert capsys.readouterr().err.splitlines() == [
        "error: the largest context that fits is 4096 tokens (--ctx-size 4096)"]
    try:
        raise AttributeError("'NoneType' object has no attribute 'n_ctx'")
    except AttributeError as exc:
        report_error(exc)
    err = capsys.readouterr().err
    assert "Traceback" in err and "AttributeError" in err and "this is a bug in dflash-agent" in err


def test_every_domain_error_is_a_user_error():
    domain = [engine.ConfigError, engine.ContextOverflowError, engine.DrafterError, engine.GGUFError,
              engine.GrammarError, engine.MemoryPlanError, engine.ModelLoadError, engine.OptionError,
              engine.RequestError, engine.TokenizerError, engine.UnsupportedTensorType, ChatError, DataError,
              TrainError]
    assert [e.__name__ for e in domain if not issubclass(e, UserError)] == []
    # Still ValueErrors: the HTTP and MCP boundaries that catch bad values keep catching them.
    assert issubclass(UserError, ValueError)


def test_bad_sampling_and_requests_are_user_errors():
    for temperature in (-1, float("nan"), float("inf")):
        with pytest.raises(UserError, match="temperature must be a finite number >= 0"):
            engine.SamplingParams(temperature=temperature)

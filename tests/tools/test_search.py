"""glob and grep: matching, deterministic order, caps; ripgrep and the Python fallback agree."""

import asyncio
import shutil

import pytest

from dflash_agent.tools.search import MAX_GLOB_RESULTS, MAX_GREP_MATCHES, GrepArgs, SearchTools, glob_regex
from dflash_agent.tools.workspace import Workspace


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "repo"
    files = {
        "README.md": "# demo\nTODO: write docs\n",
        "src/b.py": "import os\n# TODO second\n",
        "src/a.py": "def f():\n    pass  # todo lower\n# TODO first\n",
        "src/pkg/c.py": "TODO = 3\n",
        "tests/test_a.py": "def test_f():\n    assert True\n",
        ".hidden/x.py": "TODO hidden\n",
        ".git/config": "TODO git\n",
        "node_modules/m/index.js": "TODO vendored\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "data.bin").write_bytes(b"TODO\x00binary")
    return root


@pytest.fixture
def search(root):
    return SearchTools(Workspace(root))


def run(coro):
    return asyncio.run(coro)


def python_only(search):
    search.rg = None
    return search


@pytest.mark.parametrize("pattern, path, expected", [
    ("a/*.py", "a/b.py", True), ("a/*.py", "a/x/b.py", False), ("**/*.py", "b.py", True),
    ("**/*.py", "a/x/b.py", True), ("src/**", "src/a/b", True), ("*.{py,md}", "x.md", True),
    ("?.py", "ab.py", False), ("[ab].py", "b.py", True), ("[!ab].py", "b.py", False), ("*.py", "x.pyc", False),
])
def test_glob_regex(pattern, path, expected):
    assert bool(glob_regex(pattern).match(path)) is expected


def test_glob_sorted_recursive_and_skips_vcs_and_vendored(search):
    from dflash_agent.tools.search import GlobArgs

    text = run(search.glob(GlobArgs("**/*.py")))
    assert text.splitlines() == [".hidden/x.py", "src/a.py", "src/b.py", "src/pkg/c.py", "tests/test_a.py"]
    assert run(search.glob(GlobArgs("*.py", path="src"))).splitlines() == ["src/a.py", "src/b.py"]
    assert run(search.glob(GlobArgs("*", path="src"))).splitlines() == ["src/a.py", "src/b.py", "src/pkg/"]
    assert "no paths match" in run(search.glob(GlobArgs("*.rs")))


def test_glob_caps_results(search, root):
    from dflash_agent.tools.search import GlobArgs

    for i in range(MAX_GLOB_RESULTS + 5):
        (root / "many" / f"f{i:03}.txt").parent.mkdir(exist_ok=True)
        (root / "many" / f"f{i:03}.txt").write_text("")
    lines = run(search.glob(GlobArgs("many/*.txt"))).splitlines()
    assert len(lines) == MAX_GLOB_RESULTS + 1 and lines[-1].startswith("[5 more paths")


def test_grep_fallback_order_and_filters(search):
    search = python_only(search)
    text = run(search.grep(GrepArgs("TODO")))
    # Sorted by path then line; hidden, VCS, vendored and binary files skipped, as ripgrep does.
    assert text.splitlines() == [
        "README.md:2:TODO: write docs", "src/a.py:3:# TODO first", "src/b.py:2:# TODO second",
        "src/pkg/c.py:1:TODO = 3",
    ]
    assert run(search.grep(GrepArgs("todo", ignore_case=True, path="src", glob="a.py"))).splitlines() == [
        "src/a.py:2:    pass  # todo lower", "src/a.py:3:# TODO first"]
    assert run(search.grep(GrepArgs("TODO", glob="src/pkg/*.py"))).splitlines() == ["src/pkg/c.py:1:TODO = 3"]
    assert run(search.grep(GrepArgs("TODO", path="src/b.py"))).splitlines() == ["src/b.py:2:# TODO second"]
    assert "no matches" in run(search.grep(GrepArgs("nothing-like-this")))


def test_grep_caps_matches_and_long_lines(search, root):
    search = python_only(search)
    (root / "big.txt").write_text("".join(f"hit {i}\n" for i in range(MAX_GREP_MATCHES + 7)) + "hit " + "x" * 5000)
    lines = run(search.grep(GrepArgs("hit", path="big.txt"))).splitlines()
    assert len(lines) == MAX_GREP_MATCHES + 1 and lines[-1].startswith("[8 more matching lines")
    long = run(search.grep(GrepArgs("x{100}", path="big.txt")))
    assert len(long) < 700 and "omitted" in long


def test_grep_bad_regex_is_an_error(search):
    from dflash_agent.tools.tool import ToolError

    with pytest.raises(ToolError, match="not a valid regular expression"):
        run(python_only(search).grep(GrepArgs("(unclosed")))


@pytest.mark.skipif(shutil.which("rg") is None, reason="ripgrep is not installed")
def test_ripgrep_and_fallback_agree(root):
    (root / ".gitignore").write_text("")  # nothing ignored: the fallback does not read .gitignore
    (root / "long.txt").write_text("x" * 3000 + "\n")
    with_rg = SearchTools(Workspace(root))
    fallback = python_only(SearchTools(Workspace(root)))
    for args in [GrepArgs("TODO"), GrepArgs("todo", ignore_case=True), GrepArgs("TODO", path="src"),
                 GrepArgs("TODO", glob="*.md"), GrepArgs("TODO", path="src", glob="src/pkg/*.py"),
                 GrepArgs("TODO", path="src", glob="pkg/*.py"), GrepArgs("^def ", path="tests/test_a.py"),
                 GrepArgs("absent"), GrepArgs("x{100}")]:
        assert run(with_rg.grep(args)) == run(fallback.grep(args)), args


def test_python_grep_has_a_time_limit_and_leaves_the_event_loop_free(search, root, monkeypatch):
    import time

    from dflash_agent.tools import search as search_module
    from dflash_agent.tools.tool import ToolError

    monkeypatch.setattr(search_module, "GREP_TIMEOUT_S", 1)
    search.rg = None
    (root / "slow.txt").write_text("a" * 24 + "b\n")  # (a+)+$ backtracks for tens of seconds on it

    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        clock = asyncio.create_task(ticker())
        started = time.monotonic()
        with pytest.raises(ToolError, match="longer than 1 s"):
            await search.grep(GrepArgs(pattern="(a+)+$", path="slow.txt"))
        elapsed = time.monotonic() - started
        clock.cancel()
        return elapsed, ticks

    elapsed, ticks = run(scenario())
    assert elapsed < 8
    assert ticks >= elapsed / 0.05 / 4  # the loop kept turning (a blocked one would tick ~once)

"""glob and grep: matching, path order, caps; and a hostile workspace (a fake package, symlink swaps
and loops, huge files, pathological patterns)."""

import asyncio
import fnmatch
import os

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dflash_agent.tools.glob_match import Glob
from dflash_agent.tools.grep_worker import MAX_GREP_MATCHES
from dflash_agent.tools.search import MAX_GLOB_RESULTS, GlobArgs, GrepArgs, SearchTools
from dflash_agent.tools.tool import ToolError
from dflash_agent.tools.workspace import Workspace

from .loop_clock import ticking


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


@pytest.mark.parametrize("pattern, path, expected", [
    ("a/*.py", "a/b.py", True), ("a/*.py", "a/x/b.py", False), ("**/*.py", "b.py", True),
    ("**/*.py", "a/x/b.py", True), ("src/**", "src/a/b", True), ("*.{py,md}", "x.md", True),
    ("?.py", "ab.py", False), ("[ab].py", "b.py", True), ("[!ab].py", "b.py", False), ("*.py", "x.pyc", False),
    ("src/**", "src", False), ("a/**/b", "a/b", True), ("a/**/b", "a/x/y/b", True), ("a/**/b", "a/x/y/c", False),
    ("[a-c]x", "bx", True), ("[]]x", "]x", True), ("{src,tests}/*.py", "tests/a.py", True), ("[", "[", True),
    ("*a*a*a*a*a*a*a*b", "a" * 250, False), ("*a*a*a*a*a*a*a*b", "a" * 250 + "b", True),
])
def test_glob_match(pattern, path, expected):
    assert Glob(pattern).match(path) is expected


def test_glob_prunes_directories_that_cannot_match():
    assert Glob("src/*.py").may_contain("src") and not Glob("src/*.py").may_contain("lib")
    assert not Glob("src/*.py").may_contain("src/deeper")
    assert Glob("src/**/x").may_contain("src/a/b/c") and Glob("**/x").may_contain("anything")


def test_glob_sorted_recursive_and_skips_vcs_and_vendored(search):
    text = run(search.glob(GlobArgs("**/*.py")))
    assert text.splitlines() == [".hidden/x.py", "src/a.py", "src/b.py", "src/pkg/c.py", "tests/test_a.py"]
    assert run(search.glob(GlobArgs("*.py", path="src"))).splitlines() == ["src/a.py", "src/b.py"]
    assert run(search.glob(GlobArgs("*", path="src"))).splitlines() == ["src/a.py", "src/b.py", "src/pkg/"]
    assert "no paths match" in run(search.glob(GlobArgs("*.rs")))
    # a skipped folder the pattern names is entered, as with path="node_modules"
    assert run(search.glob(GlobArgs("node_modules/m/*.js"))).splitlines() == ["node_modules/m/index.js"]
    assert run(search.glob(GlobArgs("**/node_modules"))).splitlines() == ["node_modules/"]


def test_glob_caps_results(search, root):
    for i in range(MAX_GLOB_RESULTS + 5):
        (root / "many" / f"f{i:03}.txt").parent.mkdir(exist_ok=True)
        (root / "many" / f"f{i:03}.txt").write_text("")
    lines = run(search.glob(GlobArgs("many/*.txt"))).splitlines()
    assert len(lines) == MAX_GLOB_RESULTS + 1 and lines[-1].startswith("[5 more paths")


def test_grep_order_and_filters(search, root):
    text = run(search.grep(GrepArgs("TODO")))
    # Sorted by path then line; hidden, VCS, vendored and binary files skipped, as ripgrep does.
    assert text.splitlines() == [
        "README.md:2:TODO: write docs", "src/a.py:3:# TODO first", "src/b.py:2:# TODO second",
        "src/pkg/c.py:1:TODO = 3",
    ]
    assert run(search.grep(GrepArgs("todo", ignore_case=True, path="src", glob="a.py"))).splitlines() == [
        "src/a.py:2:    pass  # todo lower", "src/a.py:3:# TODO first"]
    assert run(search.grep(GrepArgs("TODO", glob="src/pkg/*.py"))).splitlines() == ["src/pkg/c.py:1:TODO = 3"]
    # a glob with a '/' is a path from the search path (as glob's pattern is) or from the root
    assert run(search.grep(GrepArgs("TODO", path="src", glob="pkg/*.py"))).splitlines() == ["src/pkg/c.py:1:TODO = 3"]
    assert run(search.grep(GrepArgs("TODO", path="src", glob="src/pkg/*.py"))).splitlines() == [
        "src/pkg/c.py:1:TODO = 3"]
    # skipped and hidden folders that the glob names are searched
    assert run(search.grep(GrepArgs("TODO", glob="node_modules/**/*.js"))).splitlines() == [
        "node_modules/m/index.js:1:TODO vendored"]
    assert run(search.grep(GrepArgs("TODO", glob=".hidden/*.py"))).splitlines() == [".hidden/x.py:1:TODO hidden"]
    (root / ".env").write_text("TODO=1\n")  # and hidden files that it asks for
    assert run(search.grep(GrepArgs("TODO", glob=".env*"))).splitlines() == [".env:1:TODO=1"]
    assert ".env" not in run(search.grep(GrepArgs("TODO")))


def test_grep_reads_utf16_and_crlf_files_as_text(search, root):
    """As ripgrep does: a UTF-16 file (told by its BOM) is searched as text, not skipped as binary, and a CRLF
    line is shown without its CR."""
    (root / "ps.txt").write_bytes(b"\xff\xfe" + "one\r\nTODO in utf-16\r\n".encode("utf-16-le"))
    (root / "win.txt").write_bytes(b"TODO crlf\r\n")
    assert run(search.grep(GrepArgs("TODO", glob="*.txt"))).splitlines() == [
        "ps.txt:2:TODO in utf-16", "win.txt:1:TODO crlf"]
    assert run(search.grep(GrepArgs("crlf\\r$", glob="*.txt"))).splitlines() == ["win.txt:1:TODO crlf"]  # CRs found
    assert run(search.grep(GrepArgs("TODO", path="src/b.py"))).splitlines() == ["src/b.py:2:# TODO second"]
    assert "no matches" in run(search.grep(GrepArgs("nothing-like-this")))


def test_grep_caps_matches_and_long_lines(search, root):
    (root / "big.txt").write_text("".join(f"hit {i}\n" for i in range(MAX_GREP_MATCHES + 7)) + "hit " + "x" * 5000)
    lines = run(search.grep(GrepArgs("hit", path="big.txt"))).splitlines()
    assert len(lines) == MAX_GREP_MATCHES + 1 and lines[-1].startswith("[8 more matching lines")
    long = run(search.grep(GrepArgs("x{100}", path="big.txt")))
    assert len(long) < 700 and "omitted" in long


def test_grep_bad_regex_is_an_error(search):
    with pytest.raises(ToolError, match="not a valid regular expression"):
        run(search.grep(GrepArgs("(unclosed")))


def test_python_grep_has_a_time_limit_and_leaves_the_event_loop_free(search, root, monkeypatch):
    from dflash_agent.tools import search as search_module

    monkeypatch.setattr(search_module, "GREP_TIMEOUT_S", 1)
    (root / "slow.txt").write_text("a" * 30 + "b\n")  # (a+)+$ backtracks for minutes on it (doubling with each a)

    async def slow_grep():
        with pytest.raises(ToolError, match="longer than 1 s"):
            await search.grep(GrepArgs(pattern="(a+)+$", path="slow.txt"))

    _, elapsed, ticks = run(ticking(slow_grep(), period=0.05))
    assert elapsed < 8
    assert ticks >= elapsed / 0.05 / 4  # the loop kept turning (a blocked one would tick ~once)


# --- a hostile workspace: the search helpers run no repo code and never leave the tree -------------------


def test_grep_helper_never_imports_the_workspace(tmp_path):
    """A `dflash_agent/` package in the repo must not shadow ours in the grep helper process."""
    root = tmp_path / "repo"
    marker = tmp_path / "pwned"
    (root / "dflash_agent" / "tools").mkdir(parents=True)
    (root / "dflash_agent" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (root / "dflash_agent" / "tools" / "__init__.py").write_text("")
    (root / "dflash_agent" / "tools" / "search.py").write_text("")
    (root / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (root / "notes.txt").write_text("x marks the spot\n")
    text = run(SearchTools(Workspace(root)).grep(GrepArgs("x marks")))
    assert not marker.exists()
    assert text == "notes.txt:1:x marks the spot"


# Run in its own process, so it swaps while the helper walks rather than between GIL switches.
SWAPPER = """
import os, sys, time
root, outside = sys.argv[1:]
d, saved = os.path.join(root, "d"), os.path.join(root, "d.saved")
while True:
    try:
        time.sleep(0.0002)
        os.rename(d, saved)
        os.symlink(outside, d)
        time.sleep(0.0001)
        os.unlink(d)
        os.rename(saved, d)
    except OSError:
        pass
"""


def test_grep_never_follows_a_symlink_swapped_in_during_the_walk(tmp_path):
    import subprocess
    import sys
    import time

    root = tmp_path / "repo"
    outside = tmp_path / "elsewhere"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    for i in range(300):  # the same names inside and out, and a walk long enough to be caught mid-way
        (root / "d" / f"f{i:03}.txt").write_text("inside data\n")
        (outside / f"f{i:03}.txt").write_text("secret data\n")
    search = SearchTools(Workspace(root))
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(root), str(outside)])
    escaped, calls, deadline = [], 0, time.monotonic() + 4
    try:
        while calls < 150 and time.monotonic() < deadline:
            calls += 1
            try:
                text = run(search.grep(GrepArgs("data")))
            except ToolError:
                continue
            if "secret" in text:
                escaped.append(text)
    finally:
        swapper.kill()
        swapper.wait()
    assert not escaped, f"{len(escaped)} of {calls} calls read outside the workspace"


def test_grep_skips_symlinks_and_survives_loops(search, root, tmp_path):
    (tmp_path / "secret.txt").write_text("TODO secret\n")
    (root / "l1").symlink_to("l2")
    (root / "l2").symlink_to("l1")
    (root / "out").symlink_to(tmp_path / "secret.txt")
    (root / "up").symlink_to("..")
    os.mkfifo(root / "pipe")
    text = run(search.grep(GrepArgs("TODO")))
    assert "secret" not in text
    assert text.splitlines()[0] == "README.md:2:TODO: write docs"
    assert run(search.grep(GrepArgs("TODO", path="src/pkg"))) == "src/pkg/c.py:1:TODO = 3"


BIG_GREP = """
import asyncio, json, resource, sys, time, tracemalloc
from pathlib import Path
from dflash_agent.tools.search import GrepArgs, SearchTools
from dflash_agent.tools.workspace import Workspace
tracemalloc.start()
started = time.monotonic()
text = asyncio.run(SearchTools(Workspace(Path(sys.argv[1]))).grep(GrepArgs("match")))
seconds = time.monotonic() - started
print(json.dumps({"lines": text.count(chr(10)) + 1, "last": text.splitlines()[-1], "seconds": seconds,
                  "server_peak": tracemalloc.get_traced_memory()[1],
                  "helper_maxrss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def test_grep_of_a_huge_matching_file_has_bounded_memory(tmp_path):
    import json
    import subprocess
    import sys

    root = tmp_path / "repo"
    root.mkdir()
    with open(root / "huge.log", "w") as f:  # 8 MB of matching lines, and a 2 MB line without a newline
        for i in range(200_000):
            f.write(f"match line {i:08} " + "y" * 20 + "\n")
        f.write("match " + "z" * 2_000_000)
    out = subprocess.run([sys.executable, "-c", BIG_GREP, str(root)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["lines"] == MAX_GREP_MATCHES + 1
    assert report["last"].startswith("[") and "more matching lines" in report["last"]
    assert report["server_peak"] < 5 * 2**20
    assert report["helper_maxrss_kb"] < 80 * 1024  # a bare Python with the package imported is ~30 MB
    assert report["seconds"] < 20


def test_glob_pathological_pattern_is_fast_and_the_loop_stays_free(search, root):
    (root / ("a" * 200)).write_text("")
    (root / ("a" * 100 + "b")).write_text("")

    text, elapsed, _ = run(ticking(search.glob(GlobArgs("*a*a*a*a*a*a*a*b"))))
    assert text == "a" * 100 + "b"
    assert elapsed < 1


def test_glob_stops_at_its_deadline_and_says_so_without_blocking_the_loop(search, root, monkeypatch):
    import time

    from dflash_agent.tools import search as search_module

    monkeypatch.setattr(search_module, "GLOB_TIMEOUT_S", 0.3)
    for i in range(50):
        (root / "many" / f"f{i:02}.txt").parent.mkdir(exist_ok=True)
        (root / "many" / f"f{i:02}.txt").write_text("")
    real_walk = search_module.walk_tree

    def slow_walk(*args, **kwargs):  # a slow disk: every entry costs 20 ms of blocking work
        for entry in real_walk(*args, **kwargs):
            time.sleep(0.02)
            yield entry

    monkeypatch.setattr(search_module, "walk_tree", slow_walk)

    text, elapsed, ticks = run(ticking(search.glob(GlobArgs("**/*.txt"))))
    assert elapsed < 1.5
    assert "stopped after 0.3 s" in text and "narrow" in text
    assert ticks >= elapsed / 0.01 / 4  # the loop kept turning while the walk ran


def test_glob_does_not_enter_symlinks_and_survives_loops(search, root, tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.py").write_text("")
    (root / "out").symlink_to(tmp_path / "outside")
    (root / "l1").symlink_to("l2")
    (root / "l2").symlink_to("l1")
    text = run(search.glob(GlobArgs("**/*.py")))
    assert "secret" not in text
    assert run(search.glob(GlobArgs("l*"))).splitlines() == ["l1", "l2"]


CANCELLED_GREP = """
import anyio, gc, sys
from pathlib import Path
from dflash_agent.tools.search import GrepArgs, SearchTools
from dflash_agent.tools.workspace import Workspace
async def main():
    with anyio.move_on_after(0.5):  # an MCP server shutting down cancels its calls this way
        await SearchTools(Workspace(Path(sys.argv[1]))).grep(GrepArgs("(a|aa)*c", path="slow.txt"))
anyio.run(main)
gc.collect()
print("done")
"""


def test_a_grep_cancelled_by_anyio_leaves_nothing_behind(root):
    import subprocess
    import sys

    (root / "slow.txt").write_text("a" * 40 + "\n")  # (a|aa)*c backtracks for minutes on it
    out = subprocess.run([sys.executable, "-c", CANCELLED_GREP, str(root)], capture_output=True, text=True,
                         timeout=60)
    warnings = [line for line in out.stderr.splitlines() if "sandbox off" not in line]  # a machine without bwrap says so
    assert out.stdout == "done\n" and warnings == [], out.stderr
    leftover = subprocess.run(["pgrep", "-f", "dflash_agent.tools.grep_worker"], capture_output=True, text=True)
    assert leftover.stdout == ""


def test_grep_streams_lines_across_chunks_and_cuts_overlong_ones(tmp_path, monkeypatch):
    from dflash_agent.tools import grep_worker

    monkeypatch.setattr(grep_worker, "READ_CHUNK", 7)
    monkeypatch.setattr(grep_worker, "MAX_LINE_BYTES", 10)
    text = b"one\ntwo three four\n\n" + b"x" * 40 + b"\nlast line, no newline"
    (tmp_path / "f").write_bytes(text)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        head = os.read(fd, 5)
        lines = list(grep_worker._lines(fd, head))
    finally:
        os.close(fd)
    # Numbered as editors number them; a line past the limit keeps its first MAX_LINE_BYTES.
    assert lines == [b"one", b"two three ", b"", b"x" * 10, b"last line,"]


NAME_CHARS = "ab.-]![*?"  # fnmatch's own syntax included, so that classes and their edge cases come up


@settings(max_examples=300, deadline=None)
@given(pattern=st.text(NAME_CHARS, max_size=10), name=st.text(NAME_CHARS, min_size=1, max_size=10))
@example(pattern="a[!]", name="aa")  # `]` right after `[!` is a member, so this class never closes
@example(pattern="[?-.!]", name="?")  # a reversed range is empty, and the `!` it leaves first negates the class
def test_glob_matches_a_name_as_fnmatch_does(pattern, name):
    assert Glob(pattern).match(name) is fnmatch.fnmatchcase(name, pattern)


@pytest.mark.parametrize("pattern", ["(" * 500 + ")" * 500, "a{4294967296}"])
def test_grep_patterns_that_break_the_regex_compiler_are_tool_errors(search, pattern):
    # RecursionError and OverflowError, not re.error: they were "internal errors" with a traceback.
    with pytest.raises(ToolError, match="not a valid regular expression"):
        run(search.grep(GrepArgs(pattern)))


def test_globs_of_many_braces_are_no_crash(search):
    braces = "*.m{d}" + "{}" * 995  # a thousand {a,b} groups were a thousand nested calls
    assert run(search.glob(GlobArgs(braces))) == "README.md"
    assert run(search.grep(GrepArgs("TODO", glob=braces))) == "README.md:2:TODO: write docs"

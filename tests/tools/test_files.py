"""Workspace confinement and the file tools, through the registry as the agent calls them."""

import asyncio
import contextlib
import os

import pytest

from dflash_agent.tools.files import MAX_READ_BYTES
from dflash_agent.tools.registry import workspace_tools
from dflash_agent.tools.workspace import Workspace

from .loop_clock import ticking


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "repo"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text("def main():\n    return 1\n\n\nif __name__ == '__main__':\n    main()\n")
    (tmp_path / "secret.txt").write_text("outside\n")
    return root


@pytest.fixture
def tools(root):
    return workspace_tools(Workspace(root))


def call(tools, name, **arguments):
    return asyncio.run(tools.dispatch(name, arguments))


@pytest.mark.parametrize("name, arguments", [
    ("read_file", {"path": "../secret.txt"}),
    ("read_file", {"path": "src/../../secret.txt"}),
    ("write_file", {"path": "../evil.txt", "content": "x"}),
    ("edit_file", {"path": "../secret.txt", "old_string": "outside", "new_string": "x"}),
    ("list_dir", {"path": ".."}),
    ("glob", {"pattern": "*", "path": ".."}),
    ("grep", {"pattern": "outside", "path": ".."}),
])
def test_dot_dot_escapes_are_refused(tools, root, name, arguments):
    result = call(tools, name, **arguments)
    assert result.is_error and "outside the workspace" in result.text
    assert not (root.parent / "evil.txt").exists()
    assert (root.parent / "secret.txt").read_text() == "outside\n"


def test_absolute_paths_outside_are_refused_inside_allowed(tools, root):
    outside = call(tools, "read_file", path=str(root.parent / "secret.txt"))
    assert outside.is_error and "outside the workspace" in outside.text
    assert call(tools, "read_file", path="/etc/passwd").is_error
    inside = call(tools, "read_file", path=str(root / "src" / "app.py"))
    assert not inside.is_error and "def main():" in inside.text


def test_symlinks_are_followed_before_the_check(tools, root):
    (root / "link_file").symlink_to(root.parent / "secret.txt")
    (root / "link_dir").symlink_to(root.parent)
    (root / "inner").symlink_to(root / "src")
    for name, arguments in [
        ("read_file", {"path": "link_file"}),
        ("read_file", {"path": "link_dir/secret.txt"}),
        ("write_file", {"path": "link_dir/new.txt", "content": "x"}),
        ("write_file", {"path": "link_file", "content": "overwritten"}),
        ("list_dir", {"path": "link_dir"}),
    ]:
        result = call(tools, name, **arguments)
        assert result.is_error and "outside the workspace" in result.text, (name, arguments, result)
    assert (root.parent / "secret.txt").read_text() == "outside\n"
    assert not (root.parent / "new.txt").exists()
    # A link that stays inside is fine.
    assert "def main" in call(tools, "read_file", path="inner/app.py").text


def test_symlink_loop_is_an_error_not_a_crash(tools, root):
    (root / "a").symlink_to(root / "b")
    (root / "b").symlink_to(root / "a")
    result = call(tools, "read_file", path="a")
    assert result.is_error


def test_read_file_numbers_lines_and_pages(tools, root):
    (root / "long.txt").write_text("".join(f"line {i}\n" for i in range(1, 101)))
    text = call(tools, "read_file", path="long.txt", offset=10, limit=3).text
    assert text.splitlines()[:3] == ["    10\tline 10", "    11\tline 11", "    12\tline 12"]
    assert "lines 10-12 of 100" in text and "offset=13" in text
    whole = call(tools, "read_file", path="long.txt").text
    assert whole.splitlines()[-1] == "   100\tline 100"
    past = call(tools, "read_file", path="long.txt", offset=101)
    assert past.is_error and "past the end" in past.text and "100 lines" in past.text


def test_read_file_refuses_binary_large_missing_and_directories(tools, root):
    (root / "blob.bin").write_bytes(b"\x7fELF\x00\x01\x02" * 10)
    assert "binary" in call(tools, "read_file", path="blob.bin").text
    with open(root / "huge.txt", "wb") as f:
        f.truncate(MAX_READ_BYTES + 1)
    huge = call(tools, "read_file", path="huge.txt")
    assert huge.is_error and "limit" in huge.text
    missing = call(tools, "read_file", path="nope.py")
    assert missing.is_error and "does not exist" in missing.text
    assert "is a directory" in call(tools, "read_file", path="src").text
    (root / "empty.txt").write_text("")
    assert "empty" in call(tools, "read_file", path="empty.txt").text


def test_read_file_caps_very_long_lines(tools, root):
    (root / "min.js").write_text("x" * 100_000 + "\n")
    text = call(tools, "read_file", path="min.js").text
    assert len(text) < 3000 and "100,000 characters" in text


def test_write_file_creates_directories_and_reports(tools, root):
    result = call(tools, "write_file", path="pkg/sub/mod.py", content="a = 1\nb = 2\n")
    assert not result.is_error and "created pkg/sub/mod.py (2 lines" in result.text
    assert (root / "pkg" / "sub" / "mod.py").read_text() == "a = 1\nb = 2\n"
    assert "overwrote" in call(tools, "write_file", path="pkg/sub/mod.py", content="").text
    assert call(tools, "write_file", path="src", content="x").is_error


def test_edit_file_unique_match(tools, root):
    result = call(tools, "edit_file", path="src/app.py", old_string="return 1", new_string="return 2")
    assert not result.is_error and "line 2" in result.text and "return 2" in result.text
    assert (root / "src" / "app.py").read_text().splitlines()[1] == "    return 2"


def test_edits_beside_a_writer_that_takes_no_lock_lose_nothing(tools, root):
    """A command appending to a file while edits replace it: an edit whose file changed after it read it reads it
    again, so every appended line and every edit is in the end; none is dropped by a replace of an old read."""
    import threading
    import time

    path = root / "log.txt"
    path.write_text("".join(f"edit-{i} old\n" for i in range(10)))
    appended = 400

    def append() -> None:
        for i in range(appended):
            with open(path, "a") as f:
                f.write(f"appended {i}\n")
            time.sleep(0.0005)

    writer = threading.Thread(target=append)
    writer.start()
    results = [call(tools, "edit_file", path="log.txt", old_string=f"edit-{i} old", new_string=f"edit-{i} new")
               for i in range(10)]
    writer.join()
    text = path.read_text()
    assert all(not r.is_error or "kept changing" in r.text for r in results), [r.text for r in results]
    assert all(f"appended {i}\n" in text for i in range(appended))
    done = [i for i, r in enumerate(results) if not r.is_error]
    assert all(f"edit-{i} new" in text for i in done)


def test_edit_file_zero_matches_says_so_and_finds_whitespace_near_miss(tools, root):
    before = (root / "src" / "app.py").read_text()
    result = call(tools, "edit_file", path="src/app.py", old_string="return 3", new_string="x")
    assert result.is_error and "0 matches" in result.text
    near = call(tools, "edit_file", path="src/app.py", old_string="return 1", new_string="x")  # exact: fine
    assert not near.is_error
    (root / "src" / "app.py").write_text(before)
    indented = call(tools, "edit_file", path="src/app.py", old_string="def main():\nreturn 1", new_string="x")
    assert indented.is_error and "0 matches" in indented.text and "line 1 if whitespace is ignored" in indented.text
    assert (root / "src" / "app.py").read_text() == before


def test_edit_file_two_matches_says_where(tools, root):
    (root / "dup.py").write_text("x = 1\ny = 2\nx = 1\n")
    result = call(tools, "edit_file", path="dup.py", old_string="x = 1", new_string="x = 3")
    assert result.is_error and "2 times" in result.text and "lines 1, 3" in result.text
    assert (root / "dup.py").read_text() == "x = 1\ny = 2\nx = 1\n"
    done = call(tools, "edit_file", path="dup.py", old_string="x = 1", new_string="x = 3", replace_all=True)
    assert not done.is_error and "2 occurrences" in done.text
    assert (root / "dup.py").read_text() == "x = 3\ny = 2\nx = 3\n"


def test_edit_file_other_mistakes(tools, root):
    written = call(tools, "write_file", path="newdir/", content="x")
    assert written.is_error and "names a directory" in written.text and not (root / "newdir").exists()
    assert "use write_file" in call(tools, "edit_file", path="new.py", old_string="", new_string="x").text
    assert "same" in call(tools, "edit_file", path="src/app.py", old_string="a", new_string="a").text
    assert "does not exist" in call(tools, "edit_file", path="new.py", old_string="a", new_string="b").text


def test_list_dir_is_sorted_and_marks_directories_and_links(tools, root):
    (root / "b.txt").write_text("")
    (root / "a.txt").write_text("")
    (root / "ln").symlink_to("a.txt")
    assert call(tools, "list_dir").text.splitlines() == ["a.txt", "b.txt", "ln -> a.txt", "src/"]
    assert call(tools, "list_dir", path="a.txt").is_error


def test_workspace_root_must_be_a_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        Workspace(tmp_path / "missing")


def test_permission_errors_become_results(tools, root):
    if os.geteuid() == 0:
        pytest.skip("root ignores file permissions")
    (root / "locked.txt").write_text("x")
    (root / "locked.txt").chmod(0)
    result = call(tools, "read_file", path="locked.txt")
    assert result.is_error and "Permission denied" in result.text


# Run in its own process, so it swaps while the tool runs rather than between GIL switches.
SWAPPER = """
import os, sys, time
root, outside = sys.argv[1:]
d, saved = os.path.join(root, "d"), os.path.join(root, "d.saved")
while True:
    try:
        time.sleep(0.0002)  # long enough for a call to check the path ...
        os.rename(d, saved)
        os.symlink(outside, d)  # ... and then be offered a symlink to open
        time.sleep(0.0001)
        os.unlink(d)
        os.rename(saved, d)
    except OSError:
        pass
"""


@pytest.mark.parametrize("name", ["read_file", "write_file", "edit_file", "list_dir"])
def test_a_symlink_swapped_in_during_the_call_never_leads_outside(tools, root, name):
    import subprocess
    import sys
    import time

    outside = root.parent / "elsewhere"
    outside.mkdir()
    (outside / "f.txt").write_text("outside data\n")
    (outside / "only_outside").write_text("")
    (root / "d").mkdir()
    (root / "d" / "f.txt").write_text("inside data\n")
    arguments = {"read_file": {"path": "d/f.txt"},
                 "write_file": {"path": "d/f.txt", "content": "inside data\n"},
                 "edit_file": {"path": "d/f.txt", "old_string": "data", "new_string": "data"},
                 "list_dir": {"path": "d"}}[name]
    if name == "edit_file":
        arguments["new_string"] = "DATA"  # edits alternate, so every call has something to replace
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(root), str(outside)])
    escaped, deadline = [], time.monotonic() + 3
    try:
        for _ in range(400):
            if time.monotonic() > deadline:
                break
            result = call(tools, name, **arguments)
            if name == "edit_file" and not result.is_error:
                arguments["old_string"], arguments["new_string"] = arguments["new_string"], arguments["old_string"]
            if "outside data" in result.text or "only_outside" in result.text:
                escaped.append(result.text)
    finally:
        swapper.kill()
        swapper.wait()
    assert (outside / "f.txt").read_text() == "outside data\n"
    assert not escaped, f"{len(escaped)} calls read outside the workspace"


def test_writes_replace_a_hard_linked_name_and_leave_the_others(tools, root):
    # A write makes a new file and renames it over the name: the other names (which may be outside,
    # `ln /outside/file x` in bash) keep the old content.
    os.link(root.parent / "secret.txt", root / "linked.txt")
    assert not call(tools, "edit_file", path="linked.txt", old_string="outside", new_string="edited").is_error
    assert (root / "linked.txt").read_text() == "edited\n"
    os.link(root.parent / "secret.txt", root / "linked2.txt")
    assert not call(tools, "write_file", path="linked2.txt", content="written\n").is_error
    assert (root / "linked2.txt").read_text() == "written\n"
    assert (root.parent / "secret.txt").read_text() == "outside\n"


def test_writes_keep_the_file_mode(tools, root):
    script = root / "run.sh"
    script.write_text("echo one\n")
    script.chmod(0o750)
    assert not call(tools, "edit_file", path="run.sh", old_string="one", new_string="two").is_error
    assert not call(tools, "write_file", path="run.sh", content="echo three\n").is_error
    assert script.read_text() == "echo three\n" and (script.stat().st_mode & 0o777) == 0o750


def test_an_edit_keeps_the_bytes_that_are_not_utf8(tools, root):
    (root / "latin1.py").write_bytes(b"name = 'caf\xe9'\nx = 2\n")
    result = call(tools, "edit_file", path="latin1.py", old_string="x = 2", new_string="x = 3")
    assert not result.is_error and "caf\ufffd" in result.text, result.text
    assert (root / "latin1.py").read_bytes() == b"name = 'caf\xe9'\nx = 3\n"  # was caf\xef\xbf\xbd: U+FFFD
    seen = call(tools, "edit_file", path="latin1.py", old_string="caf\ufffd", new_string="cafe")
    assert seen.is_error and "not UTF-8" in seen.text and "bash" in seen.text, seen.text


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_writes_keep_the_owner_and_the_setuid_bits(tools, root):
    tool = root / "tool"
    tool.write_text("one\n")
    os.chown(tool, 1234, 1234)
    tool.chmod(0o6755)
    assert not call(tools, "edit_file", path="tool", old_string="one", new_string="two").is_error
    info = tool.stat()
    # chown clears set-user-ID and set-group-ID, so the mode is given after the owner.
    assert (info.st_uid, info.st_gid, info.st_mode & 0o7777) == (1234, 1234, 0o6755)


LIMITED_WRITER = """
import asyncio, json, resource, signal, sys
from pathlib import Path
from dflash_agent.tools.registry import workspace_tools
from dflash_agent.tools.workspace import Workspace
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
tools = workspace_tools(Workspace(Path(sys.argv[1])))
calls = [("edit_file", {"path": "src/app.py", "old_string": "return 1", "new_string": "x" * 200_000}),
         ("write_file", {"path": "src/app.py", "content": "y" * 200_000}),
         ("write_file", {"path": "src/new.py", "content": "z" * 200_000}),
         ("write_file", {"path": "made/for/it/new.py", "content": "z" * 200_000})]
print(json.dumps([[r.is_error, r.text] for r in (asyncio.run(tools.dispatch(n, a)) for n, a in calls)]))
"""


def test_a_write_that_fails_part_way_leaves_the_file_as_it_was(root):
    import json
    import subprocess
    import sys

    before = (root / "src" / "app.py").read_text()
    out = subprocess.run([sys.executable, "-c", LIMITED_WRITER, str(root)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for is_error, text in json.loads(out.stdout):
        assert is_error and "File too large" in text, text
    assert (root / "src" / "app.py").read_text() == before
    assert sorted(p.name for p in (root / "src").iterdir()) == ["app.py"]  # no new file, no temp file left
    assert not (root / "made").exists()  # nor the directories made for it


def test_writes_refuse_what_is_not_a_regular_file_without_opening_it(tools, root):
    os.mkfifo(root / "pipe")
    for name, arguments in [("write_file", {"path": "pipe", "content": "x"}),
                            ("edit_file", {"path": "pipe", "old_string": "a", "new_string": "b"})]:
        result = call(tools, name, **arguments)
        assert result.is_error and "not a regular file" in result.text, result.text
    assert call(tools, "write_file", path="src", content="x").text == "src is a directory"
    assert "does not exist" in call(tools, "edit_file", path="nope/x.py", old_string="a", new_string="b").text
    assert not (root / "nope").exists()  # an edit creates no directories


def test_the_longest_names_can_be_written(tools, root):
    # 63 four-byte characters: 252 bytes, a legal name; the temporary file beside it must be legal too.
    name = "\N{GRINNING FACE}" * 63
    assert not call(tools, "write_file", path=name, content="one\n").is_error
    assert not call(tools, "edit_file", path=name, old_string="one", new_string="two").is_error
    assert (root / name).read_text() == "two\n"
    assert sorted(p.name for p in root.iterdir()) == sorted(["src", name])


def test_text_that_cannot_be_utf8_is_a_clear_error(tools, root):
    # JSON can carry a lone surrogate ("\ud800"); no UTF-8 file can hold one.
    for name, arguments in [("write_file", {"path": "s.txt", "content": "a\ud800b"}),
                            ("edit_file", {"path": "src/app.py", "old_string": "return 1", "new_string": "\udcff"})]:
        result = call(tools, name, **arguments)
        assert result.is_error and "surrogate" in result.text and "internal error" not in result.text, result.text
    assert not (root / "s.txt").exists()


def test_edits_of_many_occurrences_take_linear_time(tools, root):
    import time

    (root / "many.txt").write_text("ab\n" * 100_000)
    started = time.monotonic()
    several = call(tools, "edit_file", path="many.txt", old_string="ab", new_string="c")
    assert several.is_error and "100000 times" in several.text and "and 99980 more" in several.text
    done = call(tools, "edit_file", path="many.txt", old_string="ab", new_string="c", replace_all=True)
    assert not done.is_error and "lines 1, 2, 3" in done.text
    (root / "blank.txt").write_text("    x\n" * 200_000)
    near = call(tools, "edit_file", path="blank.txt", old_string="x\n" * 2000 + "x", new_string="y")
    assert near.is_error and "It does match at lines 1, 2, 3" in near.text and "and 197980 more" in near.text
    assert time.monotonic() - started < 5  # was minutes: line numbers and near misses were quadratic


def test_home_paths_that_do_not_resolve_say_so(tools):
    result = call(tools, "read_file", path="~no-such-user-here/x.txt")
    assert result.is_error and "home" in result.text and "symbolic links" not in result.text, result.text


def test_file_tools_leave_the_event_loop_free(tools, root, monkeypatch):
    import time

    real_fsync = os.fsync

    def slow_fsync(fd):  # a slow disk; a 10 MB replace_all costs seconds of CPU the same way
        time.sleep(0.3)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)

    async def write_and_edit():
        await tools.dispatch("write_file", {"path": "a.txt", "content": "one\n"})
        await tools.dispatch("edit_file", {"path": "a.txt", "old_string": "one", "new_string": "two"})

    _, _, ticks = asyncio.run(ticking(write_and_edit()))
    assert ticks >= 20, ticks  # 0.6 s of syncing: a blocked loop ticks about twice
    assert (root / "a.txt").read_text() == "two\n"


def test_device_nodes_are_never_opened(tools, root):
    # Opening a device can act on it (a watchdog starts its countdown, a tape rewinds); a repo
    # unpacked by root can hold one.
    import stat

    try:
        os.mknod(root / "dev", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")
    for name, arguments in [("read_file", {"path": "dev"}), ("list_dir", {"path": "dev"}),
                            ("glob", {"pattern": "*", "path": "dev"}), ("grep", {"pattern": "x", "path": "dev"})]:
        result = call(tools, name, **arguments)
        assert result.is_error and result.text.endswith("'dev' is a device; the tools never open one"), result.text


def test_a_crlf_file_reads_and_edits_with_lf_strings_and_stays_crlf(tools, root):
    """Windows checkouts: read_file shows no CRs, and old_string / new_string written with LF (as models write
    them) match and insert CRLF lines; the file keeps its line ends, and so does a whole rewrite."""
    win = root / "win.py"
    win.write_bytes(b"import os\r\nimport sys\r\n\r\ndef f():\r\n    return 1\r\n")
    assert call(tools, "read_file", path="win.py").text.splitlines()[:2] == ["     1\timport os", "     2\timport sys"]
    assert not call(tools, "edit_file", path="win.py", old_string="import sys\n", new_string="").is_error
    result = call(tools, "edit_file", path="win.py", old_string="def f():\n    return 1",
                  new_string="def f():\n    x = 2\n    return x")
    assert not result.is_error and "\r" not in result.text, result.text
    assert win.read_bytes() == b"import os\r\n\r\ndef f():\r\n    x = 2\r\n    return x\r\n"
    assert "CRLF line ends kept" in call(tools, "write_file", path="win.py", content="a\nb\n").text
    assert win.read_bytes() == b"a\r\nb\r\n"
    (root / "unix.py").write_bytes(b"a\nb\n")  # an LF file stays LF
    assert not call(tools, "edit_file", path="unix.py", old_string="a\nb", new_string="a\nc").is_error
    assert (root / "unix.py").read_bytes() == b"a\nc\n"


def test_a_file_of_mixed_line_ends_edits_as_read_file_shows_it(tools, root):
    """Each replaced text keeps its own line ends; an LF in old_string matches either, so a string across both
    kinds is found, and occurrences on either kind count alike (ambiguity, replace_all)."""
    mixed = root / "mixed.txt"
    mixed.write_bytes(b"x = 1\r\ny = 2\nx = 1\n")
    assert not call(tools, "edit_file", path="mixed.txt", old_string="x = 1\ny = 2", new_string="z = 3").is_error
    assert mixed.read_bytes() == b"z = 3\nx = 1\n"
    mixed.write_bytes(b"x = 1\r\nx = 1\n")
    assert "occurs 2 times" in call(tools, "edit_file", path="mixed.txt", old_string="x = 1\n", new_string="").text
    result = call(tools, "edit_file", path="mixed.txt", old_string="x = 1\n", new_string="a\nb\n", replace_all=True)
    assert "replaced 2 occurrences" in result.text, result.text
    assert mixed.read_bytes() == b"a\r\nb\r\na\nb\n"


CONCURRENT_EDITOR = """
import asyncio, sys
from pathlib import Path
from dflash_agent.tools.registry import workspace_tools
from dflash_agent.tools.workspace import Workspace
tools = workspace_tools(Workspace(Path(sys.argv[1])))
async def main():
    results = await asyncio.gather(*(tools.dispatch("edit_file", {
        "path": "counts.txt", "old_string": f"{sys.argv[2]}{i}\\n", "new_string": f"{sys.argv[2]}{i} done\\n"})
        for i in range(int(sys.argv[3]))))
    print(sum(r.is_error for r in results))
asyncio.run(main())
"""


def test_an_edit_waits_for_another_process_s_lock_then_gives_up_or_stops_when_cancelled(tools, root, monkeypatch):
    import fcntl

    from dflash_agent.tools import files

    monkeypatch.setattr(files, "LOCK_WAIT_S", 0.5)
    app = root / "src" / "app.py"
    before = app.read_text()
    with open(app) as held:  # as `flock` in bash, or another server's edit in progress
        fcntl.flock(held, fcntl.LOCK_EX)
        result = call(tools, "edit_file", path="src/app.py", old_string="return 1", new_string="return 2")
        assert result.is_error and "held its lock" in result.text, result.text

        async def cancelled_edits():
            edits = [asyncio.ensure_future(tools.dispatch(
                "edit_file", {"path": "src/app.py", "old_string": "return 1", "new_string": f"return {i}"}))
                for i in range(3, 15)]  # more than the threads the tools share: they wait off them
            await asyncio.sleep(0.2)
            other = await asyncio.wait_for(tools.dispatch("read_file", {"path": "src/app.py"}), 2.0)
            assert "return 1" in other.text
            for edit in edits:
                edit.cancel()
            for edit in edits:
                with contextlib.suppress(asyncio.CancelledError):
                    await edit
        monkeypatch.setattr(files, "LOCK_WAIT_S", 5.0)
        asyncio.run(cancelled_edits())
    assert app.read_text() == before


def test_edits_of_one_file_at_once_are_all_kept(root):
    """Several MCP clients, or agents on one repository, editing one file at once: each edit reads the text the
    previous one wrote (a lock on the file, across processes), none is lost while every call says it succeeded."""
    import subprocess
    import sys

    n = 40
    (root / "counts.txt").write_text("".join(f"{who}{i}\n" for who in "ab" for i in range(n)))
    editors = [subprocess.Popen([sys.executable, "-c", CONCURRENT_EDITOR, str(root), who, str(n)],
                                stdout=subprocess.PIPE, text=True) for who in "ab"]
    errors = [int(p.communicate(timeout=120)[0]) for p in editors]
    assert errors == [0, 0]
    assert (root / "counts.txt").read_text() == "".join(f"{who}{i} done\n" for who in "ab" for i in range(n))
    assert sorted(p.name for p in root.iterdir()) == ["counts.txt", "src"]  # no temporary file left


def test_a_file_that_cannot_be_replaced_is_written_in_place():
    """A writable file in a directory we may not write, or another user's file we may write: a new file could not
    be renamed there or could not keep the owner, so the file is written in place (inode and owner kept)."""
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and not setpriv:
        pytest.skip("root writes anywhere: it needs setpriv to act as another user")
    root = Path(tempfile.mkdtemp())  # not under pytest's folders, which are private to their user
    try:
        root.chmod(0o777)
        (root / "closed").mkdir()
        for path in (root / "closed" / "f.txt", root / "closed" / "g.txt", root / "shared.txt"):
            path.write_text("hello\n")
            path.chmod(0o666)
        (root / "closed").chmod(0o555)
        before = {p: (root / p).stat() for p in ("closed/f.txt", "shared.txt")}
        # and one that fails part way (a file-size limit, as a full disk): the old content is put back
        script = ("import asyncio, resource, signal, sys; from dflash_agent.tools.registry import workspace_tools; "
                  "from dflash_agent.tools.workspace import Workspace; t = workspace_tools(Workspace(sys.argv[1])); "
                  "edit = lambda p, new: asyncio.run(t.dispatch('edit_file', {'path': p, 'old_string': 'hello', "
                  "'new_string': new})); signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                  "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); "
                  "failed = edit('closed/g.txt', 'x' * 200_000); assert failed.is_error, failed.text; "
                  "print([edit(p, 'bye').is_error for p in sys.argv[2:]])")
        # as another user, root's shared.txt is another user's file; a user's own is not
        paths = ["closed/f.txt", "shared.txt"] if os.geteuid() == 0 else ["closed/f.txt"]
        as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        out = subprocess.run([*as_nobody, sys.executable, "-c", script, str(root), *paths], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert out.stdout.strip() == str([False] * len(paths)), out.stderr
        assert (root / "closed" / "g.txt").read_text() == "hello\n"
        for path in paths:
            info = (root / path).stat()
            assert (root / path).read_text() == "bye\n", path
            assert (info.st_ino, info.st_uid, info.st_gid) == (
                before[path].st_ino, before[path].st_uid, before[path].st_gid), path
    finally:
        (root / "closed").chmod(0o755)
        shutil.rmtree(root)


@pytest.mark.parametrize("bom, encoding", [(b"\xff\xfe", "utf-16-le"), (b"\xfe\xff", "utf-16-be")])
def test_a_utf16_file_reads_and_edits_as_text_and_stays_utf16(tools, root, bom, encoding):
    """What PowerShell's `>` writes (UTF-16 with a BOM, CRLF): text to the tools, not binary, and kept so."""
    path = root / "out.txt"
    path.write_bytes(bom + "name: café\r\nsize: 1\r\n".encode(encoding))
    assert call(tools, "read_file", path="out.txt").text == "     1\tname: café\n     2\tsize: 1"
    assert not call(tools, "edit_file", path="out.txt", old_string="size: 1\n", new_string="size: 2\n").is_error
    assert path.read_bytes() == bom + "name: café\r\nsize: 2\r\n".encode(encoding)
    assert "UTF-16 kept" in call(tools, "write_file", path="out.txt", content="\ufeffnew\n").text  # one BOM
    assert path.read_bytes() == bom + "new\r\n".encode(encoding)
    (root / "utf32.txt").write_bytes(b"\xff\xfe\x00\x00" + "x".encode("utf-32-le"))  # FF FE, but not UTF-16
    assert "binary file" in call(tools, "read_file", path="utf32.txt").text

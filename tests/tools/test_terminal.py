"""A command's output as a terminal shows it, checked against pyte, a VT100 emulator: what the model
reads of a line is what the screen shows."""

import pyte
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dflash_agent.tools.bash import OutputCapture
from dflash_agent.tools.terminal import _WIDTH, terminal_text

_COLUMNS = 1000  # wider than any line compared: the screen never wraps


def screen_of(text: str) -> list[str]:
    """The rows pyte shows for `text`, as a tty (onlcr) would write it: each newline a carriage return too."""
    rows = text.count("\n") + 1
    screen = pyte.Screen(_COLUMNS, rows)
    pyte.Stream(screen).feed(text.replace("\n", "\r\n"))
    return [row.rstrip(" ") for row in screen.display]


# What tools print: text, colours, carriage returns and backspaces (progress bars, spinners, overstrike),
# erases and cursor moves within the line, window titles and hyperlinks, stray NUL and BEL, newlines.
# Not tab, VT or FF: a terminal moves the cursor for them, the model reads them as they are.
_TOKENS = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=12),
    st.builds(lambda n: "x" * n, st.integers(40, 100)),
    st.sampled_from(["\r", "\x08", "\n", "\x00", "\x07", "\x1b[0m", "\x1b[1;31m", "\x1b[38;5;208m", "\x1b[K",
                     "\x1b[0K", "\x1b[1K", "\x1b[2K", "\x1b[G", "\x1b[C", "\x1b[D", "\x1b]0;a title\x07",
                     "\x1b]8;;https://example.com\x1b\\", "\x1b(B", "\x1b=", "\x1b[3X", "\x1b[X"]),
    st.builds(lambda n, final: f"\x1b[{n}{final}", st.integers(0, 60), st.sampled_from("GCDm")),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_TOKENS, max_size=30))
def test_each_line_reads_as_the_terminal_shows_it(tokens):
    text = "".join(tokens)
    screen = screen_of(text)
    assume(max(map(len, screen)) < _WIDTH)  # cursor moves stop at the edge of a _WIDTH screen, pyte's at _COLUMNS
    # a screen shows no trailing spaces, nor a line's last carriage return: both are kept for the model
    assert [line.removesuffix("\r").rstrip(" ") for line in terminal_text(text).split("\n")] == screen


@pytest.mark.parametrize(("written", "shown"), [
    ("\x1b[1;31merror\x1b[0m: no such file", "error: no such file"),
    ("Downloading  10%\rDownloading  55%\rDownloading 100%\r\ndone", "Downloading 100%\ndone"),
    ("\r\x1b[2K[1/3] cc a.c\r\x1b[2K[3/3] ld app\n", "[3/3] ld app\n"),
    ("N\x08NA\x08AM\x08ME\x08E  _\x08l_\x08s", "NAME  ls"),  # man's bold and underline
    ("working |\x08/\x08-\x08\\\x08 done", "working  done"),
    ("a\x00b\x07c\x7fd", "abcd"),
    ("see \x1b]8;;https://example.com\x1b\\the docs\x1b]8;;\x1b\\.", "see the docs."),
    ("\x1b]0;make: building\x07ok", "ok"),
    ("erase\x1b[7K mode 7 is no mode", "erase mode 7 is no mode"),
    ("tab\there, trailing spaces  ", "tab\there, trailing spaces  "),
    ("line one\x1b]0;a title that never ends\nline two", "line one\nline two"),
    ("\x1b[32m+foo\x1b[m\x1b[41m   \x1b[m", "+foo   "),  # git diff --color: whitespace it marks stays
    ("crlf\r\nlf\n", "crlf\r\nlf\n"),  # a diff of a CRLF and an LF file shows why they differ
    ("a\x00\r\n", "a\r\n"),
    ("build \u00f0\u009f\u0098\u0080 done, 3 failed", "build \u00f0\u009f\u0098\u0080 done, 3 failed"),  # mojibake
    ("cut in the middle \x1b[1;3", "cut in the middle "),
    ("erase \x1b[?2K\rall", "all"),
])
def test_what_tools_print(written, shown):
    assert terminal_text(written) == shown


def test_a_cursor_move_far_right_stops_at_the_edge():
    shown = terminal_text("x\x1b[999999999Gy\x1b[999999999Cz\x1b[" + "9" * 5000 + "Gw")
    assert shown.startswith("x ") and shown.endswith("yzw") and len(shown) < 600


def test_the_head_and_the_tail_of_cut_output_render_apart():
    capture = OutputCapture(100)
    capture.add(b"A" * 44 + b"\x1b[1;31" + b"B" * 1000 + b"\r" + b"C" * 10)
    head, note, tail = capture.text().split("\n")
    assert head == "A" * 44  # the cut sequence dropped, and the tail's carriage return does not reach back
    assert "961 bytes of output elided" in note
    assert tail == "C" * 10 + "B" * 29

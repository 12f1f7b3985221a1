"""A command's output as a terminal would show it, for the model: colours and other escape sequences
gone, each line as the last carriage return, backspace or erase left it (progress bars, spinners,
`man`'s overstrike), and no control characters but tab, newline and a CRLF's carriage return. Tools
print these even with TERM=dumb and NO_COLOR (some never look); the model would otherwise read them as
text, and a progress bar's every state costs tokens."""

from __future__ import annotations

import re

# ECMA-48's 7-bit control sequences and strings. A string (OSC: titles, hyperlinks; DCS, SOS, PM, APC) ends at ST
# or BEL; one left open ends with its line, not the output. The 8-bit forms (U+0080..U+009F) are left as text:
# programs write the 7-bit ones, and in UTF-8 output those code points are mojibake (UTF-8 read as Latin-1), which
# the model must see to debug it.
_CSI = r"\x1b\[([0-?]*)[ -/]*([@-~])"
_STRING = r"\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)?"
_ESCAPE = r"\x1b[ -/]*[0-~]"  # the two- and three-character ones: charset, keypad mode, save cursor, ...
_UNFINISHED = r"\x1b\[[0-?]*[ -/]*$"  # where the output was cut in the middle of a sequence
_CONTROL = r"[\x00-\x08\x0b-\x1f\x7f]"  # C0 but tab and newline, and DEL
_LINE_TOKEN = re.compile(
    rf"{_CSI}|{_STRING}|{_UNFINISHED}|{_ESCAPE}|(\r)|(\x08)|{_CONTROL}|([^\x00-\x08\x0b-\x1f\x7f]+)")
_NEEDS_A_SCREEN = re.compile(r"[\r\x08\x1b]")
_CONTROLS = re.compile(_CONTROL)
_WIDTH = 512  # where cursor moves stop, as a terminal's stop at its right edge (a wide one's)
_BLANK = ""  # a cell nothing was written to, or erased: a space, unless no written cell follows it


def terminal_text(text: str) -> str:
    """`text` as a terminal shows it, line by line. A line without a carriage return (but the one of a CRLF
    ending, kept: a diff of CRLF and LF files shows it), backspace or escape comes back as it is, less its
    control characters."""
    if not _NEEDS_A_SCREEN.search(text):
        return _CONTROLS.sub("", text)
    return "\n".join(_line(line) for line in text.split("\n"))


def _line(line: str) -> str:
    crlf = line.endswith("\r")
    if not _NEEDS_A_SCREEN.search(line, 0, len(line) - crlf):
        return _CONTROLS.sub("", line[:len(line) - crlf]) + "\r" * crlf
    return _render_line(line)


def _render_line(line: str) -> str:
    """One line written to a screen row: text overwrites from the cursor; carriage return, backspace and
    the cursor and erase sequences move or clear. Spaces written stay; blank cells show as spaces up to the
    last written one."""
    cells: list[str] = []
    col = 0
    blank_to = 0  # cells[:blank_to] are all blank: erasing them again is free (a bar erasing leftward each update)
    for match in _LINE_TOKEN.finditer(line):
        params, final, carriage_return, backspace, run = match.groups()
        if run:
            if col > len(cells):
                cells.extend([_BLANK] * (col - len(cells)))
            cells[col:col + len(run)] = run
            blank_to = min(blank_to, col)
            col += len(run)
        elif carriage_return:
            col = 0
        elif backspace:
            col = max(col - 1, 0)
        elif final in ("K", "X", "G", "C", "D"):
            # a missing (or private, `?`-marked) parameter is the default: 0 for K, 1 for the others
            count = _first_number(params)
            if final == "K":  # erase in line: 0 from the cursor, 1 up to it, 2 all; the cursor stays
                if not count:
                    del cells[col:]
                elif count == 1:
                    end = min(col + 1, len(cells))
                    if end > blank_to:
                        cells[blank_to:end] = [_BLANK] * (end - blank_to)
                        blank_to = end
                elif count == 2:
                    cells.clear()
            elif final == "X":  # erase n characters from the cursor, which stays
                end = min(col + max(count or 1, 1), len(cells))
                cells[col:end] = [_BLANK] * max(end - col, 0)
            elif final == "G":  # to column n (1-based)
                col = min(max((count or 1) - 1, 0), max(len(cells), _WIDTH))
            elif final == "C":
                col = min(col + max(count or 1, 1), max(len(cells), _WIDTH))
            else:
                col = max(col - max(count or 1, 1), 0)
    while cells and cells[-1] == _BLANK:
        cells.pop()
    return "".join(cell or " " for cell in cells)


def _first_number(params: str) -> int | None:
    head = params.split(";", 1)[0].lstrip("?")[:6]  # columns stop at _WIDTH; int() refuses 4300 digits
    return int(head) if head.isdigit() else None

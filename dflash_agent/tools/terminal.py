"""A command's output as a terminal would show it, for the model: colours and other escape sequences
gone, each line as the last carriage return, backspace or erase left it (progress bars, spinners,
`man`'s overstrike), and no control characters but tab and newline. Tools print these even with
TERM=dumb and NO_COLOR (some never look); the model would otherwise read them as text, and a
progress bar's every state costs tokens."""

from __future__ import annotations

import re

# ECMA-48 control sequences and strings, 7-bit (ESC [) and 8-bit (U+009B) alike. A string (OSC: titles,
# hyperlinks; DCS, SOS, PM, APC) ends at ST or BEL; one left open ends with its line, not the output.
_CSI = r"(?:\x1b\[|\x9b)([0-?]*)[ -/]*([@-~])"
_STRING = r"(?:\x1b[\]PX^_]|[\x90\x98\x9d-\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
_ESCAPE = r"\x1b[ -/]*[0-~]"  # the two- and three-character ones: charset, keypad mode, save cursor, ...
_CONTROL = r"[\x00-\x08\x0b-\x1f\x7f-\x9f]"  # C0 but tab and newline, DEL, C1
_LINE_TOKEN = re.compile(rf"{_CSI}|{_STRING}|{_ESCAPE}|(\r)|(\x08)|{_CONTROL}|([^\x00-\x08\x0b-\x1f\x7f-\x9f]+)")
_NEEDS_A_SCREEN = re.compile(r"[\r\x08\x1b\x90\x98\x9b\x9d-\x9f]")
_CONTROLS = re.compile(_CONTROL)
_WIDTH = 512  # where cursor moves stop, as a terminal's stop at its right edge (a wide one's)


def terminal_text(text: str) -> str:
    """`text` as a terminal shows it, line by line; lines without a carriage return, backspace or escape
    come back as they are, less their control characters."""
    if not _NEEDS_A_SCREEN.search(text):
        return _CONTROLS.sub("", text)
    return "\n".join(_render_line(line) if _NEEDS_A_SCREEN.search(line) else _CONTROLS.sub("", line)
                     for line in text.split("\n"))


def _render_line(line: str) -> str:
    """One line written to a screen row: text overwrites from the cursor; carriage return, backspace and
    the cursor and erase sequences move or clear. Cells never written show as spaces; trailing ones go."""
    cells: list[str] = []
    col = 0
    for match in _LINE_TOKEN.finditer(line):
        params, final, carriage_return, backspace, run = match.groups()
        if run:
            if col > len(cells):
                cells.extend(" " * (col - len(cells)))
            cells[col:col + len(run)] = run
            col += len(run)
        elif carriage_return:
            col = 0
        elif backspace:
            col = max(col - 1, 0)
        elif final in ("K", "G", "C", "D"):
            count = _first_number(params)
            if final == "K":  # erase in line: 0 from the cursor, 1 up to it, 2 all; the cursor stays
                if not count:
                    del cells[col:]
                elif count == 1:
                    end = min(col + 1, len(cells))
                    cells[:end] = " " * end
                elif count == 2:
                    cells.clear()
            elif final == "G":  # to column n (1-based)
                col = min(max((count or 1) - 1, 0), max(len(cells), _WIDTH))
            elif final == "C":
                col = min(col + max(count or 1, 1), max(len(cells), _WIDTH))
            else:
                col = max(col - max(count or 1, 1), 0)
    return "".join(cells).rstrip(" ")


def _first_number(params: str) -> int | None:
    head = params.split(";", 1)[0]
    return int(head) if head.isdigit() else None

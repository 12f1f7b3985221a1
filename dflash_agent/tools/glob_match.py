"""Glob patterns over '/'-separated relative paths, matched in polynomial time.

`*` and `?` stay within one name, a `**` segment spans any number of directories (`src/**` means
everything below src), `[...]` / `[!...]` are character classes and `{a,b}` alternatives, as in shells.
fnmatch's regular expressions backtrack: `*a*a*a*a*a*b` against a long name takes minutes. Here a
name is matched by the greedy two-pointer algorithm (each `*` remembers one restart point, so the
work is at most len(name) x len(segment)) and a path by the same algorithm over its names, with
`**` as the star."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_ALTERNATIVES = 100  # {a,b}{c,d}... expands multiplicatively


class GlobError(ValueError):
    pass


@dataclass(frozen=True)
class _Class:
    """`[...]`: the characters it takes, as fnmatch takes them, through its translation of the class alone (one
    character, so no backtracking): its quirks included, such as a reversed range being empty and what is left then
    deciding the negation (`[b-a!x]` is `[!x]`)."""
    regex: re.Pattern[str]

    def takes(self, c: str) -> bool:
        return self.regex.fullmatch(c) is not None


# Tokens: a literal character, a _Class, or one of these two markers. A path pattern is a tuple of
# segments, each a tuple of tokens or _STAR (for `**`).
_STAR, _ANY = object(), object()


def _tokens(segment: str) -> tuple[object, ...]:
    out: list[object] = []
    i = 0
    while i < len(segment):
        c = segment[i]
        if c == "*":
            if not out or out[-1] is not _STAR:  # `**` inside a name is one `*`
                out.append(_STAR)
        elif c == "?":
            out.append(_ANY)
        elif c == "[" and (end := _class_end(segment, i)) > 0:
            body = segment[i + 1:end]
            if body.startswith("^"):  # the shells' negation too, where fnmatch takes `^` as itself
                body = "!" + body[1:]
            out.append(_Class(re.compile(fnmatch.translate(f"[{body}]"))))
            i = end
        else:
            out.append(c)
        i += 1
    return tuple(out)


def _class_end(segment: str, start: int) -> int:
    """Where the `[` at `start` closes, -1 if it does not (then it is a literal `[`). A `]` right
    after `[` or `[!` is a member, as fnmatch and shells have it: `[]]`, `[!]]`."""
    i = start + 1
    if segment[i:i + 1] in ("!", "^"):
        i += 1
    return segment.find("]", i + 1)


def _wildcard(pattern: tuple[object, ...], items: Sequence[Any], one: Callable[[Any, Any], bool]) -> bool:
    """The greedy two-pointer wildcard match: `pattern`'s _STAR takes any run of items, every other
    token exactly one item for which `one(token, item)` holds."""
    p = i = 0
    star_p, star_i = -1, 0
    while i < len(items):
        if p < len(pattern) and pattern[p] is not _STAR and one(pattern[p], items[i]):
            p += 1
            i += 1
        elif p < len(pattern) and pattern[p] is _STAR:
            star_p, star_i = p, i  # try the star empty first; on a mismatch give it one more item
            p += 1
        elif star_p >= 0:
            star_i += 1
            p, i = star_p + 1, star_i
        else:
            return False
    return all(t is _STAR for t in pattern[p:])


def _char(token: object, c: str) -> bool:
    if token is _ANY:
        return True
    if isinstance(token, _Class):
        return token.takes(c)
    return token == c


def _name(token: Any, name: str) -> bool:
    return _wildcard(token, name, _char)


def _expand(pattern: str) -> list[str]:
    """`{a,b}` alternatives spelled out (not nested, as before), left to right in a loop: a pattern
    can hold a thousand groups."""
    out, rest = [""], pattern
    while (start := rest.find("{")) >= 0 and (end := rest.find("}", start)) >= 0:
        out = [done + rest[:start] + alt for done in out for alt in rest[start + 1:end].split(",")]
        if len(out) > MAX_ALTERNATIVES:
            raise GlobError(f"the pattern has more than {MAX_ALTERNATIVES} {{a,b}} alternatives; use fewer")
        rest = rest[end + 1:]
    return [done + rest for done in out]


class Glob:
    """A compiled glob: `match(path)` for a '/'-separated relative path, `may_contain(path)` to prune a
    walk (whether anything below that directory can match)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._paths: list[tuple[object, ...]] = []
        self._named: set[str] = set()
        for alt in _expand(pattern):
            segments = alt.split("/")
            self._named.update(segments)
            if segments[-1] == "**":  # `src/**`: what is below src, not src itself
                segments.append("*")
            self._paths.append(tuple(_STAR if s == "**" else _tokens(s) for s in segments))

    def match(self, path: str) -> bool:
        names = path.split("/")
        return any(_wildcard(segments, names, _name) for segments in self._paths)

    def names(self, name: str) -> bool:
        """Whether the pattern spells `name` out as one of its path's parts (`node_modules/react/*.json`): a
        search that skips such folders enters those the pattern names."""
        return name in self._named

    @property
    def dotted(self) -> bool:
        """Whether one of the pattern's parts starts with '.' (`.env*`, `**/.github/*`): it asks for hidden names."""
        return any(part.startswith(".") for part in self._named)

    def may_contain(self, path: str) -> bool:
        names = path.split("/") if path else []
        return any(_prefix(segments, names) for segments in self._paths)


def _prefix(segments: tuple[object, ...], names: list[str]) -> bool:
    """Whether some path starting with `names` (and longer) can match."""
    for depth, name in enumerate(names):
        if depth >= len(segments):
            return False
        if segments[depth] is _STAR:
            return True
        if not _name(segments[depth], name):
            return False
    return len(segments) > len(names)

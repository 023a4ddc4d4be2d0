"""Glob patterns over tensor names, matched in time linear in the pattern per position.

`fnmatch` reads a pattern in time quadratic in its length (each `[` without a closing
`]` scans to the end): a 15 KB pattern of `[` took ~10 s, under the daemon's lock.
Here a pattern is read once, left to right, with the position of the next `]` looked
up in a table built in one backward pass, and it is at most MAX_PATTERN characters.

Semantics are fnmatch.fnmatchcase's exactly (tests/core/test_patterns.py checks them
against it): `*` any run of characters, `?` one character, `[...]` a class (`[!...]`
negated, ranges `a-z`, a `]` first is literal, a `[` never closed is literal); no
escapes. Matching splits the pattern at its stars into fixed-length pieces: the first
must match the name's start, the last its end, and each piece between is taken at its
leftmost place after the previous one (greedy; a later place can never help), so a
name is scanned once per piece and nothing ever backtracks across a star.
"""
import functools
import re
import warnings

MAX_PATTERN = 4096        # characters; a longer pattern is refused (ValueError naming it)


def check(pattern):
    """`pattern` if it is a usable glob, else TypeError/ValueError saying why."""
    if not isinstance(pattern, str):
        raise TypeError(f"a pattern must be a str, not {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN:
        raise ValueError(f"pattern is {len(pattern)} characters; at most {MAX_PATTERN} are allowed")
    return pattern


@functools.lru_cache(maxsize=256)
def compile_glob(pattern):
    """The Glob for `pattern` (checked; cached: the same pattern is read once)."""
    return Glob(check(pattern))


def select(names, pattern):
    """The names (in order) that match `pattern`."""
    match = compile_glob(pattern).match
    return [n for n in names if match(n)]


class Glob:
    """A parsed glob: `match(name)` is fnmatch.fnmatchcase(name, pattern)."""

    def __init__(self, pattern):
        self.pattern = pattern
        pieces = _pieces(pattern)
        self._starred = len(pieces) > 1
        # Each piece: (regex matching exactly `length` characters, length).
        with warnings.catch_warnings():               # "possible nested set": fnmatch's too
            warnings.simplefilter("ignore", FutureWarning)
            self._pieces = [(re.compile("".join(tokens), re.DOTALL), len(tokens)) for tokens in pieces]
        self._min_length = sum(length for _, length in self._pieces)

    def match(self, name):
        n = len(name)
        if n < self._min_length:                      # the pieces cannot all fit
            return False
        pieces = self._pieces
        first, first_len = pieces[0]
        if not self._starred:
            return n == first_len and first.match(name) is not None
        last, last_len = pieces[-1]
        if first.match(name) is None or last.match(name, n - last_len) is None:
            return False
        pos, end = first_len, n - last_len           # the middle pieces go in [pos, end)
        for piece, length in pieces[1:-1]:
            found = piece.search(name, pos, end)
            if found is None:
                return False
            pos = found.end()
        return True


def _pieces(pat):
    """The pattern split at its stars: one list of single-character regex tokens per piece
    (a leading or trailing star gives an empty piece there)."""
    n = len(pat)
    next_close = [n] * (n + 1)                       # next_close[j]: first ']' at or after j
    for j in range(n - 1, -1, -1):
        next_close[j] = j if pat[j] == "]" else next_close[j + 1]
    pieces, tokens = [], []
    i = 0
    while i < n:
        c = pat[i]
        i += 1
        if c == "*":
            pieces.append(tokens)
            tokens = []
            while i < n and pat[i] == "*":
                i += 1
        elif c == "?":
            tokens.append(".")
        elif c == "[":
            j = i
            if j < n and pat[j] == "!":
                j += 1
            if j < n and pat[j] == "]":
                j += 1
            j = next_close[j]
            if j >= n:
                tokens.append(r"\[")                  # never closed: a literal '['
            else:
                tokens.append(_class(pat, i, j))
                i = j + 1
        else:
            tokens.append(re.escape(c))
    pieces.append(tokens)
    return pieces


def _class(pat, i, j):
    """The regex of the class pat[i:j] (between '[' and ']'), built as fnmatch.translate
    builds it (CPython 3.11), so that ranges, '!' and odd cases mean the same."""
    stuff = pat[i:j]
    if "-" not in stuff:
        stuff = stuff.replace("\\", r"\\")
    else:
        chunks = []
        k = i + 2 if pat[i] == "!" else i + 1
        while True:
            k = pat.find("-", k, j)
            if k < 0:
                break
            chunks.append(pat[i:k])
            i = k + 1
            k = k + 3
        chunk = pat[i:j]
        if chunk:
            chunks.append(chunk)
        else:
            chunks[-1] += "-"
        for k in range(len(chunks) - 1, 0, -1):      # empty ranges (z-a) are invalid in a regex
            if chunks[k - 1][-1] > chunks[k][0]:
                chunks[k - 1] = chunks[k - 1][:-1] + chunks[k][1:]
                del chunks[k]
        stuff = "-".join(s.replace("\\", r"\\").replace("-", r"\-") for s in chunks)
    stuff = re.sub(r"([&~|])", r"\\\1", stuff)       # no set operations
    if not stuff:
        return "(?!)"                                 # an empty class never matches
    if stuff == "!":
        return "."                                    # a negated empty class: any character
    if stuff[0] == "!":
        stuff = "^" + stuff[1:]
    elif stuff[0] in ("^", "["):
        stuff = "\\" + stuff
    return f"[{stuff}]"

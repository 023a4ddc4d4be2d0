"""Glob patterns (prefetchd/core/patterns.py): fnmatch's meaning, in linear time, with a
length limit. fnmatch.translate was quadratic: a 15 KB pattern of '[' held the daemon's
lock ~10 s in Daemon.tensors (and the control plane's I/O thread in `prefetch pattern=`)."""
import fnmatch
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from prefetchd.core import patterns

PATTERN_CHARS = "ab-*?[]!^\\"
NAME_CHARS = "ab-[]!^\\\n"


@settings(max_examples=3000, deadline=None)
@given(st.text(PATTERN_CHARS, max_size=10), st.text(NAME_CHARS, max_size=8))
def test_matches_as_fnmatchcase(pattern, name):
    assert patterns.compile_glob(pattern).match(name) == fnmatch.fnmatchcase(name, pattern)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(["*", "?", "a", "b", "[ab]", "[!a]", "[a-b]", "["]), max_size=8),
       st.text("ab[", max_size=12))
def test_matches_as_fnmatchcase_on_built_patterns(parts, name):
    pattern = "".join(parts)
    assert patterns.compile_glob(pattern).match(name) == fnmatch.fnmatchcase(name, pattern)


@pytest.mark.parametrize("pattern,name,want", [
    ("layer.*.weight", "layer.12.weight", True),
    ("layer.?.weight", "layer.12.weight", False),
    ("[]]", "]", True), ("[!]]", "a", True), ("[z-a]", "m", False), ("[!]", "!", False),
    ("[", "[", True), ("a[b", "a[b", True), ("*[", "xx[", True), ("**", "", True),
])
def test_examples(pattern, name, want):
    assert patterns.compile_glob(pattern).match(name) is want
    assert fnmatch.fnmatchcase(name, pattern) is want


HOSTILE = ["[" * patterns.MAX_PATTERN,                       # fnmatch: quadratic scan for ']'
           "[!" + "[" * (patterns.MAX_PATTERN - 3) + "x",
           "*a" * (patterns.MAX_PATTERN // 2),                 # stars: no backtracking
           "*" + "?" * (patterns.MAX_PATTERN - 2) + "b",
           "[a-z]*" * (patterns.MAX_PATTERN // 6)]


@pytest.mark.parametrize("pattern", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_pattern_of_the_longest_length_is_quick(pattern):
    names = ["a" * 1024, "[" * 1024, "a" * 1023 + "b", "x" * 500] * 25
    started = time.perf_counter()
    patterns.compile_glob.cache_clear()
    matched = patterns.select(names, pattern)
    seconds = time.perf_counter() - started
    assert matched == [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    assert seconds < 0.5, f"{seconds:.2f}s for {len(pattern)} characters"


def test_a_pattern_over_the_limit_is_refused_naming_the_limit():
    with pytest.raises(ValueError, match=f"at most {patterns.MAX_PATTERN}"):
        patterns.compile_glob("[" * (patterns.MAX_PATTERN + 1))
    with pytest.raises(TypeError, match="must be a str"):
        patterns.compile_glob(b"*")


def test_the_daemon_refuses_a_long_pattern_at_once(make_daemon, ms):
    daemon = make_daemon()
    for i in range(3):
        daemon.register(ms.Tensor(np.full(16, i, np.float32)), name=f"layer.{i}.weight", tier="remote")
    started = time.perf_counter()
    with pytest.raises(ValueError, match=f"at most {patterns.MAX_PATTERN}"):
        daemon.tensors("[" * 15000)
    assert time.perf_counter() - started < 1.0
    assert [t["name"] for t in daemon.tensors("layer.[02].*")] == ["layer.0.weight", "layer.2.weight"]
    assert [t["name"] for t in daemon.tensors("[" * patterns.MAX_PATTERN)] == []

"""The terminal neutralizer: text and SGR colours pass, every other control is printed inert, in a
stream that may split anything anywhere."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sandman.cli.terminal import SGR_MAX_PARAMS, Neutralizer, for_fd, neutralize

SGR = re.compile(rb"\x1b\[[0-9;:]*m")

CASES: list[tuple[str, bytes, bytes]] = [
    ("plain ascii", b"hello, world", b"hello, world"),
    ("kept whitespace", b"a\nb\r\nc\td\be", b"a\nb\r\nc\td\be"),
    ("utf-8", "h\u00e9llo \u20ac \U0001f600 \u00a0".encode(), "h\u00e9llo \u20ac \U0001f600 \u00a0".encode()),
    ("sgr", b"\x1b[31mred\x1b[0m", b"\x1b[31mred\x1b[0m"),
    ("sgr reset", b"\x1b[m", b"\x1b[m"),
    ("sgr truecolor", b"\x1b[38;2;1;2;3m\x1b[38:2::1:2:3m", b"\x1b[38;2;1;2;3m\x1b[38:2::1:2:3m"),
    ("osc 52 bel", b"\x1b]52;c;aGk=\x07", b"\\x1b]52;c;aGk=\\x07"),
    ("osc 52 st", b"\x1b]52;c;aGk=\x1b\\", b"\\x1b]52;c;aGk=\\x1b\\"),
    ("osc title", b"\x1b]0;pwned\x07", b"\\x1b]0;pwned\\x07"),
    ("osc 8 hyperlink", b"\x1b]8;;http://x\x1b\\x\x1b]8;;\x1b\\", b"\\x1b]8;;http://x\\x1b\\x\\x1b]8;;\\x1b\\"),
    ("erase display", b"\x1b[2J", b"\\x1b[2J"),
    ("erase line", b"\x1b[K", b"\\x1b[K"),
    ("cursor move", b"\x1b[10;20H", b"\\x1b[10;20H"),
    ("cursor up", b"\x1b[A", b"\\x1b[A"),
    ("private mode", b"\x1b[?1049h", b"\\x1b[?1049h"),
    ("device status query", b"\x1b[6n", b"\\x1b[6n"),
    ("sgr with intermediate", b"\x1b[1 m", b"\\x1b[1 m"),
    ("dcs", b"\x1bPq#0\x1b\\", b"\\x1bPq#0\\x1b\\"),
    ("apc", b"\x1b_Gf=100;AAAA\x1b\\", b"\\x1b_Gf=100;AAAA\\x1b\\"),
    ("pm", b"\x1b^secret\x1b\\", b"\\x1b^secret\\x1b\\"),
    ("sos", b"\x1bXhi\x1b\\", b"\\x1bXhi\\x1b\\"),
    ("reset terminal", b"\x1bc", b"\\x1bc"),
    ("save cursor", b"\x1b7", b"\\x1b7"),
    ("charset", b"\x1b(0", b"\\x1b(0"),
    ("double esc", b"\x1b\x1b[31m", b"\\x1b\x1b[31m"),
    ("esc before sgr param", b"\x1b[3\x1b[31m", b"\\x1b[3\x1b[31m"),
    ("bel", b"ding\x07", b"ding\\x07"),
    ("nul", b"a\x00b", b"a\\x00b"),
    ("vt ff", b"\x0b\x0c", b"\\x0b\\x0c"),
    ("shift out/in", b"\x0e\x0f", b"\\x0e\\x0f"),
    ("del", b"\x7f", b"\\x7f"),
    ("c1 csi byte", b"\x9b2J", b"\\x9b2J"),
    ("c1 osc byte", b"\x9d52;c;aGk=\x9c", b"\\x9d52;c;aGk=\\x9c"),
    ("c1 range", bytes(range(0x80, 0xA0)), b"".join(b"\\x%02x" % b for b in range(0x80, 0xA0))),
    ("c1 csi utf-8", "\u009b2J".encode(), b"\\u009b2J"),
    ("c1 osc utf-8", "\u009d0;t\u009c".encode(), b"\\u009d0;t\\u009c"),
    (
        "c1 utf-8 range",
        "".join(map(chr, range(0x80, 0xA0))).encode(),
        b"".join(b"\\u%04x" % c for c in range(0x80, 0xA0)),
    ),
    ("overlong esc", b"\xc0\x9b", b"\\xc0\\x9b"),
    ("overlong 3-byte", b"\xe0\x80\x9b", b"\\xe0\\x80\\x9b"),
    ("surrogate", b"\xed\xa0\x80", b"\\xed\\xa0\\x80"),
    ("beyond U+10FFFF", b"\xf4\x90\x80\x80", b"\\xf4\\x90\\x80\\x80"),
    ("invalid byte", b"\xff", b"\\xff"),
    ("truncated char then text", b"\xe2\x82x", b"\\xe2\\x82x"),
    ("latin-1 csi", b"caf\xe9\x1b[2J", b"caf\\xe9\\x1b[2J"),
]


@pytest.mark.parametrize(("data", "expected"), [(d, e) for _, d, e in CASES], ids=[c[0] for c in CASES])
def test_table(data: bytes, expected: bytes) -> None:
    assert neutralize(data) == expected


@pytest.mark.parametrize(("data", "expected"), [(d, e) for _, d, e in CASES], ids=[c[0] for c in CASES])
def test_table_split_at_every_boundary(data: bytes, expected: bytes) -> None:
    for i in range(len(data) + 1):
        n = Neutralizer()
        assert n.feed(data[:i]) + n.feed(data[i:]) + n.flush() == expected, i
    n = Neutralizer()  # and one byte at a time
    assert b"".join(n.feed(data[i : i + 1]) for i in range(len(data))) + n.flush() == expected


def test_a_whole_sequence_is_held_then_released_at_once() -> None:
    n = Neutralizer()
    assert n.feed(b"ok \x1b") == b"ok "
    assert n.feed(b"[3") == b""
    assert n.feed(b"1") == b""
    assert n.feed(b"mred") == b"\x1b[31mred"
    assert n.feed(b"\xe2\x82") == b""
    assert n.feed(b"\xac") == "\u20ac".encode()
    assert n.feed(b"\xc2") == b""
    assert n.feed(b"\x9b") == b"\\u009b"


def test_unfinished_sequence_at_the_end_is_neutralized_by_flush() -> None:
    for tail in (b"\x1b", b"\x1b[", b"\x1b[31;4", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc2"):
        n = Neutralizer()
        out = n.feed(b"x" + tail)
        assert out == b"x"
        rest = n.flush()
        assert b"\x1b" not in rest and rest.startswith(b"\\x")
        assert n.flush() == b""  # nothing held twice


def test_unterminated_sequence_is_bounded() -> None:
    n = Neutralizer()
    out = n.feed(b"\x1b[")
    for _ in range(10_000):
        out += n.feed(b"1;")
        assert len(n._pending) <= SGR_MAX_PARAMS + 2
    out += n.feed(b"m") + n.flush()
    assert out.startswith(b"\\x1b[1;1;") and out.endswith(b"1;m")
    assert b"\x1b" not in out
    # An unterminated OSC is never held at all: it is text the moment it arrives.
    n = Neutralizer()
    assert n.feed(b"\x1b]52;c;") == b"\\x1b]52;c;"
    assert n.feed(b"A" * 100_000) == b"A" * 100_000


def test_longest_sgr_passes_and_one_longer_does_not() -> None:
    ok = b"\x1b[" + b"1" * SGR_MAX_PARAMS + b"m"
    assert neutralize(ok) == ok
    long = b"\x1b[" + b"1" * (SGR_MAX_PARAMS + 1) + b"m"
    assert neutralize(long) == b"\\x1b[" + b"1" * (SGR_MAX_PARAMS + 1) + b"m"


def test_for_fd_is_none_for_pipes_and_raw(tmp_path: object) -> None:
    import os
    import pty

    r, w = os.pipe()
    try:
        assert for_fd(w) is None
    finally:
        os.close(r)
        os.close(w)
    master, slave = pty.openpty()
    try:
        assert isinstance(for_fd(slave), Neutralizer)
        assert for_fd(slave, raw=True) is None
    finally:
        os.close(master)
        os.close(slave)
    assert for_fd(12345) is None  # not open at all


# --- properties -------------------------------------------------------------------------------


def assert_inert(out: bytes) -> None:
    """Nothing in ``out`` can control a terminal: ESC only as the start of an SGR, no other C0
    but \\n \\r \\t \\b, no DEL, valid UTF-8 without C1 controls."""
    text = SGR.sub(b"", out)
    assert b"\x1b" not in text
    assert b"\x07" not in out
    for b in text:
        assert b >= 0x20 or b in b"\n\r\t\b", out
        assert b != 0x7F, out
    decoded = out.decode("utf-8")  # strict: raises on anything a terminal could misread
    assert not any(0x80 <= ord(c) <= 0x9F for c in decoded), out


interesting = st.sampled_from(
    [b"\x1b", b"[", b"]", b"P", b"\\", b"m", b"J", b"H", b";", b":", b"1", b"52", b"?", b"\x07", b"\x9b", b"\x9c",
     b"\x9d", b"\xc2", b"\xc2\x9b", b"\xe2\x82", b"\xac", b"\xed", b"\xf0\x9f", b"\x98\x80", b"\xc0", b"\xff", b"\n",
     b"\r", b"\b", b"\t", b"\x00", b"\x7f", b"a"]
)  # fmt: skip
hostile = st.one_of(st.binary(max_size=200), st.lists(interesting, max_size=60).map(b"".join))


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@settings(max_examples=500, deadline=None)
@given(hostile, st.lists(st.integers(min_value=0, max_value=1000), max_size=20))
@example(b"\x1b]52;c;aGk=\x07\x1b[2J", [3, 9])
def test_output_is_inert_and_chunking_does_not_matter(data: bytes, cuts: list[int]) -> None:
    n = Neutralizer()
    out = b""
    for chunk in chunked(data, cuts):
        out += n.feed(chunk)
        assert len(n._pending) <= SGR_MAX_PARAMS + 2
    out += n.flush()
    assert_inert(out)
    assert out == neutralize(data)
    assert neutralize(out) == out  # what it writes is already safe


plain_text = st.text(
    st.characters(blacklist_categories=("Cs",)).filter(
        lambda c: c in "\n\r\t\b" or (c >= " " and not "\x7f" <= c <= "\x9f")
    ),
    max_size=80,
)
sgr = st.lists(st.sampled_from(["", "0", "1", "31", "38", "5", "2", "255", "48", ":"]), max_size=8).map(
    lambda parts: "\x1b[" + ";".join(parts) + "m"
)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(plain_text, sgr), max_size=12).map("".join), st.lists(st.integers(0, 1000), max_size=20))
def test_text_and_sgr_pass_unchanged(text: str, cuts: list[int]) -> None:
    data = text.encode()
    n = Neutralizer()
    out = b"".join(n.feed(chunk) for chunk in chunked(data, cuts)) + n.flush()
    assert out == data

"""Secret scrubbing and leak detection for everything a sandboxed command prints.

One module on purpose: the automaton's needles, the views, ``Scrubber`` (about 580 lines by itself)
and its stream form share the encoding arithmetic (base64 and base32 cores, mixed characters, window
and line cuts) that must agree byte for byte; only the credential pattern table could stand apart.

Two kinds of secrets are caught, plain and encoded (base64 standard and URL-safe, with or without
padding; URL percent-encoding; hex in either case; for known secrets also base32, upper case as
``base32`` and RFC 4648 write it), also when the text is dressed up the cheap, common ways (see
"Views"):

* known secrets, given by name and value (the operator's own keys): every occurrence becomes
  ``[REDACTED:<name>]``. Values shorter than ``MIN_SECRET_LEN`` (4) characters are ignored: they
  would match all over ordinary output. When known values overlap, the longest match wins.
* credentials sandman was not told about, found by ``PATTERNS`` (OpenAI, Anthropic, OpenRouter,
  GitHub, GitLab, Google, AWS, Slack, Discord, Telegram, Stripe, PEM private keys): each becomes
  ``[REDACTED:<kind>]``, or blocks the output, or is only reported (``LeakAction``). Of a
  Telegram bot token only the secret after the colon goes (the bot id before it is public); of an
  AWS secret key, only the key.

A hit is a ``Finding``: kind, fingerprint, byte span and encoding, never the value. The
fingerprint is the first 12 hex digits of an HMAC-SHA256 of the decoded value under a per-process
random key (or the ``fingerprint_key`` given): equal values share a fingerprint within a process,
whatever their encoding, but a fingerprint cannot be tested against guessed values by anyone
without the key -- a plain hash could, and known secrets may well be guessable passwords.

How it is fast (figures: scripts/bench_scrub.py). Every literal to look for -- each known secret
in each of its forms, each pattern's fixed start ("anchor", e.g. ``ghp_``) and the encoded forms
of those anchors -- goes into one Aho-Corasick automaton (``ahocorasick_rs``, a DFA: measured at
over 500 MB/s where ``pyahocorasick`` gave about 50 and a regex alternation about 10), so the text
is read once whatever the number of secrets, and regexes run only where an anchor was seen (a
byte check first drops anchors glued to a word, like the ``sk-`` in ``task-``). Patterns without a
fixed start (Discord, Telegram) are found by ``bytes.find`` of their shape in a copy of the text
where every token character is the same letter. For their encoded forms, base64 runs long enough
to hold a token are first decoded all at once at each alignment (C speed) and only decoded again
window by window where that shows a token's shape. Without ``ahocorasick_rs`` a regex alternation
stands in: same results, much slower.

How base64 of a substring is found: its encoding depends on the value's offset modulo 3 in the
encoded blob, so each value is encoded at offsets 0, 1 and 2 and the characters that mix in
neighbouring bytes are dropped; any of those three "cores" marks an occurrence. The redaction
then also takes the one mixed character on each side of a known secret (and the ``=`` padding)
when present, so no bit of the secret is left behind (of a pattern's token, only the mixed
character after it: the one before holds bits of its public anchor). Base32 the same way, offsets
0 to 4, taking the mixed character after the value but not the one before (up to 4 bits of the
first character stay). From an encoded anchor, decoding follows line breaks, so a private key run
through ``base64`` (76 columns) or ``xxd -p`` is redacted whole.

Views. Where the output holds escapes, a second pass reads a decoded copy of it (a "view", with
a map back to the original offsets) and keeps the hits that touch a decoded place:

* JSON escapes: ``\\uXXXX`` (surrogate pairs too) and ``\\/`` -- so ``\\u0067hp_...`` or a secret
  with every character escaped is caught; ``\\"`` and ``\\\\`` too when a known secret holds a quote
  or a backslash (no pattern does, and JSON logs are full of them: without that, ``\\\\`` is not
  decoded and ``\\\\u0067`` may be read as ``\\g`` -- more redacted, never less). ``\\n`` and the
  like are already understood by the patterns' boundaries;
* terminal control sequences (ANSI CSI, e.g. the SGR colour codes ``ESC[31m``, raw or as
  ``\\u001b[``), dropped, so colour codes between the characters of a secret or a token, or
  right before a token (its boundary), do not hide it; the redaction then takes the codes inside
  the hit with it. Such a view maps its offsets back only when something is found in it;
* base64 wrapped in lines (``base64`` at 76 columns, PEM and ``openssl`` at 64): the line break
  after a whole line of 40 to 128 base64 characters, before another base64 character, is
  dropped, so the base64 of a known secret or of a pattern's anchor broken by a line break is
  caught (only base64 and base32 forms are looked for in joined lines: joining could glue a
  token to the line before it).
Plain output pays only a quick scan for escapes and for lines that start with 40 base64
characters; the second pass is made where they are.

Streaming (``Scrubber.stream()``) gives exactly the bytes that scrubbing the whole input at once
gives: chunking never matters. ``feed`` holds back only what a match may still need: the longest
needle plus 4 bytes, 128 bytes for the unanchored patterns, the current window (up to 512 bytes)
inside a long base64 run, an escape cut short at the end, and from an anchor seen near the end up
to that pattern's bound -- every pattern's token is at most ``MAX_TOKEN`` (512) bytes (of a longer
run, the first 512 are redacted), a PEM key body at most ``PEM_MAX_BODY`` (16 KiB; a key without
its END line is redacted up to the first character that cannot be in one) -- and it never splits a
multi-byte UTF-8 character.

``release`` (for a stream gone idle) keeps that guarantee too: it sends everything except the
tail that could still be the beginning of a secret -- a prefix of any needle (a known secret in any
of its forms, or a pattern's anchor in any of its forms; a boundary rule rules some out, like the
``sk`` of ``task``), a base64 character that could be the mixed character before a known
secret's core, a pattern's token not yet ended (``ghp_`` and the token characters after it, up
to the pattern's maximal length), an unanchored token's beginning (a Discord token's start; a
Telegram token's secret part), the end of a base64 or hex run whose decoding ends in token
characters from where an encoded Discord token or Telegram secret could start, an escape cut
short, or a line break after a whole line of base64. That tail is bounded: the longest needle, a
pattern's maximal length (a PEM body's: 16 KiB), plus at most 128 characters at the end of a long
base64 run; it goes out as soon as the next bytes settle it, and ``flush`` scrubs whatever is
left. Output ending at a line end, a blank or most punctuation goes out whole; a partial line
(a progress bar, a prompt, the echo of a keystroke) may keep its last one to three characters
until the next output when they could begin a secret in one of its forms -- with base64 and hex
forms about, most letters and digits can.

Out of scope -- not caught: arbitrary transforms of a secret (reversal, compression such as
gzip+base64, encryption, ROT13, character substitutions); encodings nested in encodings (base64 of
hex, base64 of JSON-escaped text, ...); hex in mixed case; percent-encoding of characters that do
not need it (``%67hp_``); HTML entities, ``\\x67`` or octal escapes; terminal sequences other than
CSI (OSC hyperlinks, charset switches), 8-bit CSI; wrapped base64 whose lines are shorter than 40
or longer than 128 characters, or do not start a line; a Discord or Telegram token (they have no
anchor) base64-encoded across a line break or inside escapes; base32 in lower case; a secret
split across two separate streams (stdout and stderr) or across separate commands.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import hashlib
import hmac
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import accumulate, chain, repeat
from typing import Literal, NamedTuple, Protocol
from urllib.parse import quote, quote_plus

from pydantic import BaseModel, ConfigDict

from sandman.errors import SandmanError

try:
    import ahocorasick_rs  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # the regex engine stands in
    ahocorasick_rs = None  # type: ignore[assignment, unused-ignore]

MIN_SECRET_LEN = 4
MAX_TOKEN = 512
PEM_MAX_BODY = 16384

_SLACK = 128  # how far past a match's end any pattern may read (lookaheads, optional tails)
# Bytes kept before the unsent data: lookbehinds, base64 groups, a Telegram token's bot id...
_CTX = 16
_BACK = 4  # how far before its needle a hit may start (base64 groups, mixed characters)
_PROBE_HOLD = 128  # longest unanchored token (Discord: 73 bytes) plus lookarounds, rounded up
_B64_MINRUN = 56  # shortest base64 run that can hold an unanchored token (Telegram: 44 bytes)
_HEX_MINRUN = 88  # the same for hex
_SEG = 512  # long base64 runs are decoded in windows of this size...
_STEP = 256  # ...starting every STEP characters: any token (<= 100 encoded chars) fits one window
_VIEW_BACK = 1024  # a view starts this far before its first escape (a hit's reach before it)
_ESC_TAIL = 64  # the longest escape that may be cut short at the end of the buffer
_WRAP_MIN, _WRAP_MAX = 40, 128  # the length of a wrapped base64 line
_LINE_CTX = _WRAP_MAX + 8  # context kept back to the start of a line of base64 the cut is in
_ESC_CTX = 96  # ...and when escapes are near the cut (a bot id of 10 escaped digits, a colour code)

# What a round may assume about the bytes after the buffer.
_FEED = 0  # more are coming: hold back whatever a match may still need (generously)
_RELEASE = 1  # more may come, the stream is idle: hold back only what could still begin a match
_FINAL = 2  # none

EXAMPLE_KEYS: frozenset[str] = frozenset(
    {
        # AWS's documented example credentials, in countless READMEs and test suites
        "AKIAIOSFODNN7EXAMPLE",
        "ASIAIOSFODNN7EXAMPLE",
        "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    }
)


class LeakAction(StrEnum):
    """What a hit does to the output: replaced, refused as a whole, or only reported."""

    REDACT = "redact"
    BLOCK = "block"
    WARN = "warn"


Encoding = Literal["plain", "base64", "base64url", "base32", "url", "hex"]


class Finding(BaseModel):
    """One secret in the output. Offsets are in bytes of the input (characters for ``scan_text``);
    the value itself is never kept, only its keyed fingerprint."""

    model_config = ConfigDict(frozen=True)

    kind: str
    fingerprint: str
    start: int
    end: int
    encoding: Encoding


class SecretLeakBlocked(SandmanError):
    """Output was refused because it carried a secret (policy action ``block``)."""

    def __init__(self, finding: Finding) -> None:
        self.finding = finding
        super().__init__(
            f"output blocked: it contains a {finding.kind} secret (fingerprint {finding.fingerprint}); "
            "keep the secret out of the command's output, or use the redact action"
        )


@dataclass(frozen=True)
class LeakPattern:
    """A credential format. ``anchors``: literal bytes every match starts with (found by the
    automaton); without anchors, ``probes`` find it: (shape, back) pairs where shape is searched in
    the text with every token character turned into ``a`` and a match starts 0..back bytes before.
    A group named ``secret``, when present, is the part to redact. ``boundary``: bytes that cannot
    directly precede a match unless part of a ``\\n`` or ``%XX`` escape (what its lookbehind says):
    lets the many false anchors ("task-", "disk-") be dropped before any regex runs.

    For ``release`` (an idle stream), what may still change with more bytes: ``pending``
    fullmatches the bytes from an anchor to the end while there is no match yet but could be one
    (any prefix of a match fits it); ``pending_tail`` fullmatches the bytes after a match while it
    could still grow; ``tail`` (unanchored patterns) is searched near the end and matches the
    beginning of a token that reaches it (its ``secret`` group, if any, is where the held part
    starts). Without them, the anchor's ``window`` is held."""

    kind: str
    regex: re.Pattern[bytes]
    anchors: tuple[bytes, ...] = ()
    probes: tuple[tuple[bytes, int], ...] = ()
    window: int = MAX_TOKEN + _SLACK  # furthest a successful match attempt reads past its start
    # ...and one that fails: the fixed start, the minimum count, lookarounds (at most ~80 here)
    miss_window: int = _SLACK
    boundary: frozenset[int] = frozenset()
    pending: re.Pattern[bytes] | None = None
    pending_tail: re.Pattern[bytes] | None = None
    tail: re.Pattern[bytes] | None = None


_WORD = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"
# Most keys follow a word boundary; so do a JSON escape ("\nsk-...") and a URL escape ("%3Dsk-...").
_ESCAPED = rb"(?<=\\[nrt])|(?<=%[0-9A-Fa-f]{2})"
_B = rb"(?:(?<![A-Za-z0-9_-])|" + _ESCAPED + rb")"
_PEM_HEAD = rb"-----BEGIN[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----"
_PEM_BODY = rb"(?:[A-Za-z0-9+/=\s:,.]|\\[nrt/]|-(?!----)){0,%d}" % PEM_MAX_BODY
_PEM_TAIL = rb"(?:-----END[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----)?"


def _p(
    kind: str,
    regex: bytes,
    anchors: Iterable[str],
    pending: bytes,
    window: int = MAX_TOKEN + _SLACK,
    boundary: bytes = b"",
    pending_tail: bytes | None = None,
) -> LeakPattern:
    return LeakPattern(
        kind,
        re.compile(regex),
        tuple(a.encode() for a in anchors),
        (),
        window,
        _SLACK,
        frozenset(boundary),
        re.compile(pending),
        re.compile(pending_tail) if pending_tail else None,
    )


_DISCORD_CHAR = rb"[A-Za-z0-9_-]"
PATTERNS: tuple[LeakPattern, ...] = (
    _p(
        "openai",
        _B + rb"sk-(?:(?:proj|svcacct|admin)-[A-Za-z0-9_-]{20,480}|[A-Za-z0-9]{20,480})",
        ["sk-"],
        rb"sk-[A-Za-z0-9_-]{0,490}",
        boundary=_WORD,
    ),
    _p(
        "anthropic", _B + rb"sk-ant-[A-Za-z0-9_-]{20,480}", ["sk-ant-"], rb"sk-ant-[A-Za-z0-9_-]{0,480}", boundary=_WORD
    ),
    _p(
        "openrouter",
        _B + rb"sk-or-v1-[A-Za-z0-9]{32,480}",
        ["sk-or-v1-"],
        rb"sk-or-v1-[A-Za-z0-9]{0,480}",
        boundary=_WORD,
    ),
    _p(
        "github",
        rb"gh[pousr]_[A-Za-z0-9]{36,251}",
        ["ghp_", "gho_", "ghu_", "ghs_", "ghr_"],
        rb"gh[pousr]_[A-Za-z0-9]{0,251}",
    ),
    _p("github", rb"github_pat_[A-Za-z0-9_]{22,244}", ["github_pat_"], rb"github_pat_[A-Za-z0-9_]{0,244}"),
    _p("gitlab", rb"glpat-[A-Za-z0-9_-]{20,250}", ["glpat-"], rb"glpat-[A-Za-z0-9_-]{0,250}"),
    _p("google_api", rb"AIza[0-9A-Za-z_-]{35}", ["AIza"], rb"AIza[0-9A-Za-z_-]{0,35}"),
    _p(
        "aws_access_key",
        rb"(?:(?<![A-Z0-9])|" + _ESCAPED + rb")(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])",
        ["AKIA", "ASIA"],
        rb"(?:AKIA|ASIA)[A-Z0-9]{0,16}",
        boundary=_WORD[:26] + _WORD[52:62],
    ),
    _p(
        "aws_secret_key",
        # quotes may be JSON-escaped: {\"secretAccessKey\": \"...\"} in a log line
        rb"(?i:secret[_-]?access[_-]?key)\\?[\"']?\s{0,8}[:=]{1,2}\s{0,8}\\?[\"']?"
        rb"(?P<secret>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+])",
        [
            "secret_access_key",
            "SECRET_ACCESS_KEY",
            "Secret_Access_Key",
            "secretAccessKey",
            "SecretAccessKey",
            "secret-access-key",
        ],
        rb"(?i:secret[_-]?access[_-]?key)\\?[\"']?\s{0,8}[:=]{0,2}\s{0,8}\\?[\"']?[A-Za-z0-9/+]{0,40}",
    ),
    _p(
        "slack",
        rb"xox[abpr]-[A-Za-z0-9-]{10,250}",
        ["xoxa-", "xoxb-", "xoxp-", "xoxr-"],
        rb"xox[abpr]-[A-Za-z0-9-]{0,250}",
    ),
    _p("slack", rb"xapp-[A-Za-z0-9-]{20,250}", ["xapp-"], rb"xapp-[A-Za-z0-9-]{0,250}"),
    _p(
        "stripe",
        rb"(?:sk|rk)_live_[A-Za-z0-9]{16,247}|sk_test_[A-Za-z0-9]{16,247}",
        ["sk_live_", "rk_live_", "sk_test_"],
        rb"(?:sk|rk)_live_[A-Za-z0-9]{0,247}|sk_test_[A-Za-z0-9]{0,247}",
    ),
    _p(
        "private_key",
        _PEM_HEAD + _PEM_BODY + _PEM_TAIL,
        ["-----BEGIN"],
        rb"-----BEGIN[A-Z0-9 -]{0,70}",
        window=PEM_MAX_BODY + 200 + _SLACK,
        # the body stopped at the start of an END line, or of an escape, cut short
        pending_tail=rb"-{1,5}(?:E(?:N(?:D[A-Z0-9 -]{0,70})?)?)?|\\",
    ),
    # The first part is base64 of a decimal user id: "M", "N" or "O", then "D", "T", "j" or "z".
    LeakPattern(
        "discord",
        re.compile(
            _B + rb"[MNO][DTjz][A-Za-z0-9_-]{22,24}\.[A-Za-z0-9_-]{6}\.[A-Za-z0-9_-]{27,38}"
            rb"(?![A-Za-z0-9_-])"
        ),
        probes=((b"a" * 23 + b".aaaaaa." + b"a" * 27, 3),),
        tail=re.compile(
            _B
            + rb"[MNO](?:[DTjz](?:%(c)s{0,24}|%(c)s{22,24}\.(?:%(c)s{0,6}|%(c)s{6}\.%(c)s{0,38})))?\Z"
            % {b"c": _DISCORD_CHAR}
        ),
    ),
    LeakPattern(
        "telegram",
        re.compile(
            rb"(?:(?<![0-9])|" + _ESCAPED + rb")[0-9]{8,10}(?::|%3[Aa])(?P<secret>[A-Za-z0-9_-]{35})(?![A-Za-z0-9_-])"
        ),
        probes=((b"a" * 8 + b":" + b"a" * 35, 2), (b"a" * 8 + b"%" + b"a" * 37, 2)),
        tail=re.compile(rb"(?:(?<![0-9])|" + _ESCAPED + rb")[0-9]{8,10}(?::|%3[Aa])(?P<secret>[A-Za-z0-9_-]{0,35})\Z"),
    ),
)


def _shape_table(letters: bytes, kept: bytes = b"") -> bytes:
    """A bytes.translate table: ``letters`` -> "a", ``kept`` -> themselves, the rest -> space."""
    table = bytearray(b" " * 256)
    for c in letters:
        table[c] = 0x61
    for c in kept:
        table[c] = c
    return bytes(table)


_B64_CHARS = frozenset(_WORD + b"+/")
_B64_STD = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_B32_UPPER = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
_B32_CHARS = frozenset(_B32_UPPER)
_HEX_CHARS = frozenset(b"0123456789abcdefABCDEF")
_TOKEN_BYTES = _WORD + b"."  # what a decoded unanchored token's redacted part is made of
_T_PROBE = _shape_table(_WORD, b":%.")  # the separators the probes look for stay
_T_B64 = _shape_table(_WORD + b"+/")
_T_LINES = _shape_table(_WORD + b"+/", b"\r\n")
_STD_TO_URLSAFE = bytes.maketrans(b"+/", b"-_")
_URLSAFE_TO_STD = bytes.maketrans(b"-_", b"+/")
_NOT_B64 = bytes(c for c in range(256) if c not in _B64_CHARS)
_NOT_HEX = bytes(c for c in range(256) if c not in _HEX_CHARS)
_HEX_RUN = re.compile(rb"[0-9a-fA-F]{%d,}" % _HEX_MINRUN)
_HEX_TAIL = re.compile(rb"[0-9a-fA-F]*\Z")
_BREAK_TAIL = re.compile(rb"\r?\n?")  # after an encoded run at the end: a line break may go on
_B64_RUN_TAIL = re.compile(rb"\r?\n?|==?")  # ...or padding

# Escapes a view decodes (see the module doc): a CSI sequence, raw or JSON-escaped, is dropped; a
# JSON \uXXXX (a surrogate pair as one) and \/ become what they stand for -- and \" and \\ when a
# known secret has a quote or a backslash (nothing else can: in JSON logs they are everywhere).
# Without \\, no match holds an ESC or a backslash but at its start (a pair's second half aside),
# so where a scan begins does not change what it finds after its first match.
_CSI = rb"\[[0-?]{0,32}[ -/]{0,8}[@-\[\]-~]"
_TERMINAL = re.compile(rb"\x1b" + _CSI)
_JSON_ESCAPES = (
    rb"\x1b" + _CSI + rb"|\\u001[bB]" + _CSI + rb"|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
    rb"|\\u[0-9a-fA-F]{4}|\\/"
)
_ESCAPE = re.compile(_JSON_ESCAPES)
_ESCAPE_QUOTES = re.compile(_JSON_ESCAPES + rb"|\\[\"\\]")
# The beginning of one at the very end (or of a longer one: \u001b may be a CSI, \uD83D a pair).
_ESCAPE_CUT = re.compile(
    rb"(?:\x1b(?:\[[0-?]{0,32}[ -/]{0,8})?"
    rb"|\\(?:u(?:[0-9a-fA-F]{0,3}|001[bB](?:\[[0-?]{0,32}[ -/]{0,8})?"
    rb"|[dD][89abAB][0-9a-fA-F]{2}(?:\\(?:u[0-9a-fA-F]{0,3})?)?)?)?)\Z"
)
# In the line shape (_T_LINES, a "\n" put first at the stream's start): a line break between two
# lines of base64, the first a whole line of 40 to 128 characters; and one that may become that.
_JOIN = re.compile(rb"(?<=\n)a{%d,%d}(\r?\n)(?=a)" % (_WRAP_MIN, _WRAP_MAX))
_JOIN_CUT = re.compile(rb"(?<=\n)a{%d,%d}(\r\n?|\n)\Z" % (_WRAP_MIN, _WRAP_MAX))
_JOIN_GATE = re.compile(rb"\n[A-Za-z0-9+/_-]{%d}" % _WRAP_MIN)  # cheap: a line that may be one


# -- what a needle in the automaton stands for ------------------------------------------------


@dataclass(frozen=True)
class _SecretForm:
    name: str
    value: bytes
    encoding: Encoding
    lext: bool = False  # base64: a mixed character may precede the core
    pad: int = 0  # base64/32: a mixed character (and up to ``pad`` "=") may follow the core


@dataclass(frozen=True)
class _Anchor:
    pattern: int
    encoding: Literal["plain", "base64", "hex"]
    align: int = 0  # base64: the anchor's offset modulo 3 in the encoded blob


class _Hit(NamedTuple):
    start: int
    end: int
    lo: int  # the earliest byte this hit depends on being unsent (its trigger or its start)
    kind: str
    encoding: Encoding
    value: bytes
    rank: int  # 0 known secret, 1 pattern: a known name wins a tie


def _b64_cores(value: bytes) -> list[tuple[int, bytes]]:
    """(offset mod 3, the characters of base64(value) that do not depend on its neighbours)."""
    cores = []
    for k in range(3):
        enc = binascii.b2a_base64(b"\0" * k + value, newline=False)
        first, stop = -(-8 * k // 6), 8 * (k + len(value)) // 6
        cores.append((k, enc[first:stop]))
    return cores


def _b32_cores(value: bytes) -> list[tuple[int, bytes, int]]:
    """(offset mod 5, the characters of base32(value) that do not depend on its neighbours, how
    many "=" may follow the mixed character after them; 0: no mixed character)."""
    cores = []
    for k in range(5):
        enc = base64.b32encode(b"\0" * k + value)
        first, stop = -(-8 * k // 5), 8 * (k + len(value)) // 5
        cores.append((k, enc[first:stop], (0, 6, 4, 3, 1)[(k + len(value)) % 5]))
    return cores


def _mixed_before(first: int) -> frozenset[int]:
    """The base64 characters (either alphabet) that can be the mixed one before the core of a
    value starting with byte ``first``: their low bits are its top bits (offset 1: 4, offset 2: 2)."""
    chars = set()
    for bits in (4, 2):
        for v, c in enumerate(_B64_STD):
            if v & ((1 << bits) - 1) == first >> (8 - bits):
                chars.add(c)
                chars.add(bytes([c]).translate(_STD_TO_URLSAFE)[0])
    return frozenset(chars)


class _Index(Protocol):
    def find(self, data: bytes, pos: int) -> list[tuple[int, int, int]]:
        """Every (needle id, start, end), overlapping ones included, at least those with
        start >= pos (callers skip any before)."""
        ...


class _AhoCorasickIndex:
    def __init__(self, needles: list[bytes]) -> None:
        assert ahocorasick_rs is not None
        self._ac = ahocorasick_rs.BytesAhoCorasick(needles, implementation=ahocorasick_rs.Implementation.DFA)

    def find(self, data: bytes, pos: int) -> list[tuple[int, int, int]]:
        # The whole buffer: pos is at most _CTX bytes in, and shifting every hit costs more.
        return self._ac.find_matches_as_indexes(data, overlapping=True)


class _RegexIndex:
    """The stand-in: a lookahead alternation finds every start, a table the needles there."""

    def __init__(self, needles: list[bytes]) -> None:
        alternation = b"|".join(re.escape(n) for n in sorted(needles, key=len, reverse=True))
        self._rx = re.compile(b"(?=(?:" + alternation + b"))")
        self._by_head: dict[bytes, list[tuple[int, bytes]]] = {}
        for i, n in enumerate(needles):
            self._by_head.setdefault(n[:3], []).append((i, n))

    def find(self, data: bytes, pos: int) -> list[tuple[int, int, int]]:
        out = []
        for m in self._rx.finditer(data, pos):
            s = m.start()
            for i, n in self._by_head.get(data[s : s + 3], ()):
                if data.startswith(n, s):
                    out.append((i, s, s + len(n)))
        return out


_PROCESS_KEY = os.urandom(32)


@dataclass
class _Round:
    """What one pass over the buffer decided: where output may stop, and the merged hits."""

    cut: int
    regions: list[tuple[int, int, _Hit]] = field(default_factory=list)
    escapes: bool = False  # the buffer holds an ESC or a backslash


class _View:
    """The buffer with escapes decoded or wrapped base64's line breaks dropped (``data``), as
    pieces alternating literal (same bytes) and decoded (an escape, a line break: ``spots`` are
    their offsets in ``data``), with the map from offsets in ``data`` back to the buffer's.

    ``parts`` are the literal pieces of ``buf[lo:end]``, ``toks`` the escapes between them and
    ``reps`` what those stand for; everything is computed with C-level list operations. A view of
    terminal codes alone (``terminal``) is made lazily: its data is one ``re.sub`` and its map is
    only built when a needle is found in it (seldom: colour codes rarely sit inside a secret)."""

    __slots__ = (
        "_buf",
        "_lo",
        "begin",
        "bst",
        "cut_short",
        "data",
        "end",
        "joined",
        "spots",
        "tok_ends",
        "tok_starts",
        "vst",
    )
    data: bytes
    begin: int
    bst: list[int]  # each piece's offset in the buffer (and the end's, last)
    vst: list[int]  # ...in data; empty while not mapped (terminal codes only)
    spots: list[int]
    tok_starts: list[int]
    tok_ends: list[int]

    def __init__(
        self,
        buf: bytes,
        lo: int,
        end: int,
        begin: int,
        cut_short: bool,
        pieces: tuple[list[bytes], list[bytes], list[bytes]] | None = None,
        joined: bool = False,
    ) -> None:
        self._buf, self._lo, self.end = buf, lo, end
        self.cut_short = cut_short  # an escape cut short at the end will decode to something: a spot
        self.joined = joined  # lines joined: only base64 forms are looked for there
        if pieces is not None:
            self._map(*pieces)
            # the first byte of data at or after the buffer's begin
            i = bisect.bisect_right(self.bst, begin) - 1
            if i < 0:
                self.begin = 0
            elif i >= len(self.bst) - 1:
                self.begin = len(self.data)
            elif i % 2 == 0:
                self.begin = self.vst[i] + min(begin - self.bst[i], self.bst[i + 1] - self.bst[i])
            else:
                self.begin = self.vst[i] if begin == self.bst[i] else self.vst[i + 1]
        else:  # terminal codes only; no code straddles begin (a cut never splits an escape)
            self.data = _TERMINAL.sub(b"", buf[lo:end])
            self.begin = len(_TERMINAL.sub(b"", buf[lo:begin])) if begin > lo else 0
            self.vst = []

    def _map(self, parts: list[bytes], toks: list[bytes], reps: list[bytes]) -> None:
        last = parts[-1:]
        self.data = b"".join(chain(chain.from_iterable(zip(parts, reps, strict=False)), last))
        plen = list(map(len, parts))
        # Even pieces are literal, odd ones decoded; each one's offset in the buffer and in data.
        self.bst = list(
            accumulate(chain(chain.from_iterable(zip(plen, map(len, toks), strict=False)), plen[-1:]), initial=self._lo)
        )
        self.vst = list(
            accumulate(chain(chain.from_iterable(zip(plen, map(len, reps), strict=False)), plen[-1:]), initial=0)
        )
        self.spots = self.vst[1:-1:2]
        self.tok_starts = self.bst[1:-1:2]
        self.tok_ends = self.bst[2:-1:2]
        if self.cut_short:
            self.spots.append(len(self.data))

    def _ready(self) -> None:
        if not self.vst:
            text = self._buf[self._lo : self.end]
            toks = _TERMINAL.findall(text)
            self._map(_TERMINAL.split(text), toks, [b""] * len(toks))

    def start(self, v: int) -> int:
        """Where the byte at ``v`` in data starts in the buffer (its escape's start)."""
        if v >= len(self.data):
            return self.end
        v = max(v, 0)
        if not self.vst:
            return self._start_near_end(v)
        i = bisect.bisect_right(self.vst, v, 0, len(self.vst) - 1) - 1
        return self.bst[i] + (v - self.vst[i] if i % 2 == 0 else 0)

    def _start_near_end(self, v: int) -> int:
        # Not mapped yet (terminal codes only): map just a tail that holds data[v:], from an ESC
        # (never inside a code, so the codes after it are read as the whole view reads them).
        buf, need = self._buf, len(self.data) - v
        q = self.end - need + 1
        while True:
            q = buf.rfind(b"\x1b", self._lo, q)
            if q < 0:
                self._ready()
                return self.start(v)
            got = len(_TERMINAL.sub(b"", buf[q : self.end]))
            if got >= need:
                text = buf[q : self.end]
                toks = _TERMINAL.findall(text)
                tail = _View(buf, q, self.end, q, False, (_TERMINAL.split(text), toks, [b""] * len(toks)))
                return tail.start(got - need)
            q -= need - got

    def stop(self, v: int) -> int:
        """Where the byte before ``v`` in data ends in the buffer (its escape's end)."""
        self._ready()
        i = bisect.bisect_right(self.vst, v - 1, 0, len(self.vst) - 1) - 1
        return self.bst[i] + v - self.vst[i] if i % 2 == 0 else self.bst[i + 1]

    def near(self, lo: int, hi: int) -> bool:
        """Whether a decoded piece starts in data[lo:hi + 1]."""
        self._ready()
        i = bisect.bisect_left(self.spots, lo)
        return i < len(self.spots) and self.spots[i] <= hi

    def inside(self, cut: int) -> int:
        """``cut``, moved back to the start of the escape it would split."""
        if not self.vst:  # terminal codes only: the last ESC before the cut tells
            q = self._buf.rfind(b"\x1b", max(self._lo, cut - _ESC_TAIL), cut)
            m = _TERMINAL.match(self._buf, q) if q >= 0 else None
            return q if m and m.end() > cut else cut
        i = bisect.bisect_left(self.tok_starts, cut) - 1
        return self.tok_starts[i] if i >= 0 and self.tok_ends[i] > cut else cut


_UNESCAPED: dict[bytes, bytes] = {}
_MISSING = b"\0missing"


def _unescape(tok: bytes) -> bytes:
    """What an escape (see _ESCAPE) stands for: b"" for a control sequence; a lone surrogate is
    left as it is."""
    if tok[0] == 0x1B or tok[6:7] == b"[":
        return b""
    if tok[1] != 0x75:  # \/ \" \\
        return tok[1:2]
    if len(tok) == 12:
        hi, lo = int(tok[2:6], 16), int(tok[8:12], 16)
        return chr(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)).encode()
    cp = int(tok[2:6], 16)
    return tok if 0xD800 <= cp < 0xE000 else chr(cp).encode()


def _unescape_all(toks: list[bytes]) -> list[bytes]:
    reps = list(map(_UNESCAPED.get, toks, repeat(_MISSING)))
    if _MISSING in reps:
        if len(_UNESCAPED) > 4096:
            _UNESCAPED.clear()
        for i, rep in enumerate(reps):
            if rep is _MISSING:
                reps[i] = _UNESCAPED[toks[i]] = _unescape(toks[i])
    return reps


class Scrubber:
    """Finds and handles secrets in output; build once, use from many streams.

    ``secrets`` maps a name to a value that must never appear (values under
    ``MIN_SECRET_LEN`` characters are ignored); ``patterns`` turns on ``PATTERNS``; values in
    ``allowlist`` (e.g. ``EXAMPLE_KEYS``) are never reported; ``action`` applies to every hit.
    ``engine`` picks the literal search: "auto" is Aho-Corasick when ``ahocorasick_rs`` is
    installed, else a regex alternation.
    """

    def __init__(
        self,
        secrets: Mapping[str, str],
        patterns: bool = True,
        allowlist: Iterable[str] = (),
        action: LeakAction = LeakAction.REDACT,
        *,
        fingerprint_key: bytes | None = None,
        engine: Literal["auto", "aho-corasick", "regex"] = "auto",
    ) -> None:
        self.action = LeakAction(action)
        self.patterns = PATTERNS if patterns else ()
        self._allow = frozenset(v.encode() for v in allowlist)
        self._key = fingerprint_key or _PROCESS_KEY
        actions: dict[bytes, list[_SecretForm | _Anchor]] = {}

        def add(needle: bytes, action: _SecretForm | _Anchor) -> None:
            entry = actions.setdefault(needle, [])
            if action not in entry:
                entry.append(action)

        mixed: set[int] = set()  # characters that may be the mixed one before a known base64 core
        for name, value in secrets.items():
            if len(value) < MIN_SECRET_LEN or value.encode() in self._allow:
                continue
            raw = value.encode()
            add(raw, _SecretForm(name, raw, "plain"))
            quoted = quote(value, safe="")
            for url in {quoted, quote_plus(value, safe=""), _lower_escapes(quoted)}:
                if url != value:
                    add(url.encode(), _SecretForm(name, raw, "url"))
            add(raw.hex().encode(), _SecretForm(name, raw, "hex"))
            add(raw.hex().upper().encode(), _SecretForm(name, raw, "hex"))
            for k, core in _b64_cores(raw):
                pad = (3 - (k + len(raw)) % 3) % 3
                for variant in {core, core.translate(_STD_TO_URLSAFE)}:
                    add(variant, _SecretForm(name, raw, "base64", k > 0, pad))
            mixed |= _mixed_before(raw[0])
            for _, core, pad in _b32_cores(raw):  # upper case only, as base32(1) and RFC 4648 write it
                add(core, _SecretForm(name, raw, "base32", False, pad))
        for i, pat in enumerate(self.patterns):
            for anchor in pat.anchors:
                add(anchor, _Anchor(i, "plain"))
                add(anchor.hex().encode(), _Anchor(i, "hex"))
                add(anchor.hex().upper().encode(), _Anchor(i, "hex"))
                for k, core in _b64_cores(anchor):
                    for variant in {core, core.translate(_STD_TO_URLSAFE)}:
                        add(variant, _Anchor(i, "base64", k))
        quoting = any(c in v for v in secrets.values() for c in '"\\\\')
        self._escape = _ESCAPE_QUOTES if quoting else _ESCAPE
        needles = self._needles = list(actions)
        self._actions = [actions[n] for n in needles]
        self._b64_actions = [[a for a in acts if a.encoding in ("base64", "base32")] for acts in self._actions]
        self._mixed = frozenset(mixed)
        # Per needle, the bytes before it that rule out every one of its actions (see boundary),
        # and how far past its start a hit it triggers may reach (for the view's locality check).
        self._ruled_out: list[frozenset[int]] = []
        self._reach: list[int] = []
        for n, acts in zip(needles, self._actions, strict=True):
            ruled: frozenset[int] | None = None
            reach = len(n) + 8
            for a in acts:
                plain = isinstance(a, _Anchor) and a.encoding == "plain"
                bound = self.patterns[a.pattern].boundary if isinstance(a, _Anchor) and plain else frozenset()
                ruled = bound if ruled is None else ruled & bound
                if isinstance(a, _Anchor):
                    reach = max(reach, 2 * self.patterns[a.pattern].window + 8)
            self._ruled_out.append(ruled or frozenset())
            self._reach.append(reach)
        # Every proper prefix of a needle: (bytes that rule it out, whether the hit may start one
        # character before it) -- what release() holds back at the end of the buffer.
        prefixes: dict[bytes, tuple[frozenset[int] | None, bool]] = {}
        for n, acts, ruled in zip(needles, self._actions, self._ruled_out, strict=True):
            back = any(isinstance(a, _SecretForm) and a.lext for a in acts)
            for j in range(1, len(n)):
                old_ruled, old_back = prefixes.get(n[:j], (None, False))
                prefixes[n[:j]] = (ruled if old_ruled is None else old_ruled & ruled, old_back or back)
        self._prefixes = {p: (r or frozenset(), b) for p, (r, b) in prefixes.items()}
        self._index: _Index | None = None
        use_ac = engine == "aho-corasick" or (engine == "auto" and ahocorasick_rs is not None)
        if needles:
            self._index = _AhoCorasickIndex(needles) if use_ac else _RegexIndex(needles)
        self.engine = "none" if self._index is None else "aho-corasick" if use_ac else "regex"
        self._probed = [(i, p) for i, p in enumerate(self.patterns) if p.probes]
        # Bounded scanners for the encoded neighbourhood of an anchor, one per pattern; base64 and
        # hex go on across line breaks (``base64`` wraps at 76 columns, ``xxd -p`` at 60).
        self._b64_run = [_wrapped_run(rb"[A-Za-z0-9+/_-]", (p.window // 3 + 2) * 4) for p in self.patterns]
        self._hex_run = [_wrapped_run(rb"[0-9a-fA-F]", 2 * p.window + 2) for p in self.patterns]
        self._url_run = [re.compile(rb"[A-Za-z0-9_.~+%%-]{0,%d}" % (3 * p.window)) for p in self.patterns]
        self._longest = max((len(n) for n in needles), default=0)
        # What must stay unsent at the end of the buffer whatever was found there.
        self._hold = max(self._longest + _BACK if needles else 0, _PROBE_HOLD if self._probed else 0)

    # -- public conveniences ------------------------------------------------------------------

    def stream(self) -> StreamScrubber:
        """A scrubber for one output stream, fed chunk by chunk."""
        return StreamScrubber(self)

    def scrub_bytes(self, data: bytes) -> tuple[bytes, list[Finding]]:
        """``data`` with secrets handled per ``action``, and the findings (byte offsets).
        Raises SecretLeakBlocked under ``block``."""
        s = self.stream()
        out = s._flush_all(bytes(data))
        return out, s.findings

    def scrub_text(self, text: str) -> tuple[str, list[Finding]]:
        """Like scrub_bytes for text; offsets are in characters."""
        data = text.encode("utf-8", "surrogatepass")
        out, findings = self.scrub_bytes(data)
        return out.decode("utf-8", "surrogatepass"), _char_offsets(data, findings)

    def scan_text(self, text: str) -> list[Finding]:
        """The findings in ``text`` (character offsets), whatever the action; never raises."""
        data = text.encode("utf-8", "surrogatepass")
        done = self._round(data, 0, 0, final=True)
        return _char_offsets(data, [self._finding(r, 0) for r in done.regions])

    # -- the engine ---------------------------------------------------------------------------

    def _fingerprint(self, value: bytes) -> str:
        return hmac.new(self._key, value, hashlib.sha256).hexdigest()[:12]

    def _finding(self, region: tuple[int, int, _Hit], base: int) -> Finding:
        start, end, hit = region
        return Finding(
            kind=hit.kind,
            fingerprint=self._fingerprint(hit.value),
            start=base + start,
            end=base + end,
            encoding=hit.encoding,
        )

    def _round(
        self, buf: bytes, begin: int, base: int, final: bool, release: bool = False, win: int | None = None
    ) -> _Round:
        """Find what ``buf[begin:]`` holds and how much of it can be sent.

        ``buf[:begin]`` was sent already (kept for lookbehinds); ``base`` is ``buf[0]``'s offset in
        the stream; ``win`` (<= begin) is where the base64 windows to decode may start. Every hit
        is a function of the bytes around its trigger only, so a hit whose bytes are all here is
        the same in any chunking; the cut keeps back anything that is not. ``release``: the
        stream is idle -- keep back only what could still begin a match (see the module doc).
        """
        mode = _FINAL if final else _RELEASE if release else _FEED
        end = len(buf)
        hits, limit = self._scan(buf, begin, base, mode, begin if win is None else win, None)
        views, held, escapes = self._views(buf, begin, base, mode)
        limit = min(limit, held)
        for view in views:
            vhits, vlimit = self._scan(view.data, view.begin, 0, mode, None, view)
            for h in vhits:
                if view.near(min(h.lo, h.start) - 4, h.end):  # from its trigger (an anchor) on
                    hits.append(
                        _Hit(
                            view.start(h.start), view.stop(h.end), view.start(h.lo), h.kind, h.encoding, h.value, h.rank
                        )
                    )
            if mode != _FINAL:
                limit = min(limit, view.start(vlimit))
        # Hits of bytes already sent (found again from the context) are done; none can straddle.
        hits = [h if h.start >= begin else h._replace(start=begin) for h in hits if h.end > begin]
        if self._allow:
            hits = [h for h in hits if h.value not in self._allow]
        regions = _merge(hits)
        if final:
            return _Round(end, regions, escapes)
        cut = max(limit, begin)
        while True:
            new = _utf8_cut(buf, cut)
            for view in views:
                new = view.inside(new)
            for h in hits:
                if h.lo < new < h.end:
                    new = h.lo
            for s0, e0, _ in regions:
                if s0 < new < e0:
                    new = s0
            new = max(new, begin)
            if new == cut:
                break
            cut = new
        return _Round(cut, [r for r in regions if r[1] <= cut], escapes)

    def _scan(
        self, buf: bytes, begin: int, base: int, mode: int, win: int | None, view: _View | None
    ) -> tuple[list[_Hit], int]:
        """The hits in ``buf[begin:]`` and the limit the matchers put on the cut. On a view's
        data (``view``), only needles near a decoded piece are looked at, and no long runs; on
        joined lines, only the base64 and base32 forms."""
        end = len(buf)
        hits: list[_Hit] = []
        if mode == _FINAL:
            limit = end
        elif mode == _RELEASE:
            limit = self._tail_hold(buf, begin)
        else:
            limit = end - self._hold
        if self._index is not None:
            ruled_out, reach = self._ruled_out, self._reach
            for nid, s, e in self._index.find(buf, begin):
                if s < begin:
                    continue
                ruled = ruled_out[nid]
                # Inline for speed (text like "task-" is full of these): glued to a word, no escape.
                if ruled and s >= 3 and buf[s - 1] in ruled and buf[s - 2] != 0x5C and buf[s - 3] != 0x25:
                    continue
                if view is not None and not view.near(s - 4, s + reach[nid]):
                    continue
                for act in self._b64_actions[nid] if view is not None and view.joined else self._actions[nid]:
                    if isinstance(act, _SecretForm):
                        lim = self._secret_hit(act, buf, s, e, mode, hits)
                    else:
                        lim = self._anchor_hit(act, buf, s, e, mode, hits)
                    if lim is not None and lim < limit:
                        limit = lim
        if self._probed and not (view is not None and view.joined):
            stop = end - _PROBE_HOLD if mode == _FEED else end
            # From before begin: a Telegram token's bot id may have been sent, its secret not.
            for pat, ms, me, value, t in self._probe(buf, max(begin - 16, 0), stop):
                hits.append(_Hit(ms, me, t, pat.kind, _probe_encoding(buf, ms, me), value, 1))
            if mode == _RELEASE:
                limit = min(limit, self._probe_tail(buf, begin))
            if win is not None:
                lim = self._long_runs(buf, win, base, mode, hits)
                if lim < limit:
                    limit = lim
        return hits, limit

    # -- what an idle stream still holds back ------------------------------------------------

    def _tail_hold(self, buf: bytes, begin: int) -> int:
        """Where the longest end of ``buf`` that is a needle's proper prefix starts (one earlier for
        a base64 core, whose hit takes the mixed character before it); a last character that may be
        the mixed one before a known secret's base64 core is held too."""
        end = len(buf)
        for k in range(min(self._longest - 1, end - begin), 0, -1):
            info = self._prefixes.get(buf[end - k :])
            if info is None:
                continue
            ruled, back = info
            p = end - k
            if ruled and p >= 3 and buf[p - 1] in ruled and buf[p - 2] != 0x5C and buf[p - 3] != 0x25:
                continue
            return max(p - 1 if back and p > begin and buf[p - 1] in _B64_CHARS else p, begin)
        if end > begin and buf[end - 1] in self._mixed:
            return end - 1
        return end

    def _probe_tail(self, buf: bytes, begin: int) -> int:
        """Where an unanchored token that reaches the end of ``buf`` (so may still grow) starts."""
        end = len(buf)
        hold = end
        for _, pat in self._probed:
            if pat.tail is None:
                hold = min(hold, end - _PROBE_HOLD)
                continue
            m = pat.tail.search(buf, max(begin - 16, 0, end - _PROBE_HOLD))
            if m:
                hold = min(hold, m.start("secret") if "secret" in pat.tail.groupindex else m.start())
        return max(hold, begin)

    def _anchor_pending(self, pat: LeakPattern, m: re.Match[bytes] | None, buf: bytes, s: int) -> bool:
        """Whether more bytes may still change the match at anchor ``s`` (release mode)."""
        end = len(buf)
        if m is not None:
            if m.end() >= end:
                return True
            return pat.pending_tail is not None and pat.pending_tail.fullmatch(buf, m.end()) is not None
        if pat.pending is None:
            return s + pat.miss_window > end
        return pat.pending.fullmatch(buf, s) is not None

    # -- the views ----------------------------------------------------------------------------

    def _views(self, buf: bytes, begin: int, base: int, mode: int) -> tuple[list[_View], int, bool]:
        """The views of ``buf`` that have a decoded piece near the unsent bytes -- escapes decoded;
        wrapped base64's lines joined (looked at for base64 forms only: a joined line could hide a
        token's boundary) -- and where an escape or a wrapped line's break cut short by the end of
        the buffer starts (it is held, and its view is made even with nothing decoded yet: what
        precedes it may begin a match it continues)."""
        end = len(buf)
        esc_end = join_end = end
        escapes = buf.find(b"\x1b") >= 0 or buf.find(b"\\") >= 0
        tail = max(end - _ESC_TAIL, 0)
        if escapes and mode != _FINAL and (buf.find(b"\x1b", tail) >= 0 or buf.find(b"\\", tail) >= 0):
            m = _ESCAPE_CUT.search(buf, tail)
            if m:
                esc_end = m.start()
        if mode != _FINAL and end and buf[end - 1] in b"\r\n":
            lo = max(end - _WRAP_MAX - 3, 0)
            first = b"\n" if lo == 0 and base == 0 else b""
            m = _JOIN_CUT.search(first + buf[lo:end].translate(_T_LINES))
            if m:
                join_end = lo - len(first) + m.start(1)
        src_end = min(esc_end, join_end)
        views = []
        m = None
        if escapes:
            m = self._escape.search(buf, 0, src_end)
        if m is not None or esc_end < end:
            lo = max((m.start() if m else src_end) - _VIEW_BACK, 0)
            last = None
            for last in self._escape.finditer(buf, max(begin - _ESC_TAIL, lo), src_end):
                if last.end() > begin - 8:
                    break
            if esc_end < end or (last is not None and last.end() > begin - 8):
                if buf.find(b"\\", lo, src_end) < 0:
                    views.append(_View(buf, lo, src_end, begin, esc_end < end))
                else:
                    text = buf[lo:src_end]
                    toks = self._escape.findall(text)
                    pieces = (self._escape.split(text), toks, _unescape_all(toks))
                    views.append(_View(buf, lo, src_end, begin, esc_end < end, pieces))
        joins: list[tuple[int, int]] = []
        gate = max(begin - _WRAP_MAX - 8, 0)
        if _JOIN_GATE.search(buf, gate, src_end) or (base == 0 and _JOIN_GATE.match(b"\n" + buf[:_WRAP_MIN])):
            first = b"\n" if base == 0 else b""
            lines = first + buf[:src_end].translate(_T_LINES)
            shift = len(first)
            joins = [(m.start(1) - shift, m.end(1) - shift) for m in _JOIN.finditer(lines)]
        if (joins and joins[-1][1] > begin - 8) or join_end < end:
            lo = max((joins[0][0] if joins else src_end) - _VIEW_BACK, 0)
            cuts = [lo, *chain.from_iterable(joins), src_end]
            parts = [buf[a:b] for a, b in zip(cuts[::2], cuts[1::2], strict=True)]
            toks = [buf[a:b] for a, b in joins]
            views.append(_View(buf, lo, src_end, begin, join_end < end, (parts, toks, [b""] * len(toks)), joined=True))
        return views, src_end, escapes

    # -- the matchers -------------------------------------------------------------------------

    def _secret_hit(self, form: _SecretForm, buf: bytes, s: int, e: int, mode: int, hits: list[_Hit]) -> int | None:
        start, stop, encoding = s, e, form.encoding
        if encoding in ("base64", "base32"):
            if mode == _FEED and e + 1 + form.pad > len(buf):
                return s - 1
            alphabet = _B64_CHARS if encoding == "base64" else _B32_CHARS
            # The characters that mix the secret's first and last bits with its neighbours'.
            if form.lext and s > 0 and buf[s - 1] in alphabet:
                start = s - 1
            if form.pad and e < len(buf) and buf[e] in alphabet:
                stop = e + 1
                while stop - e <= form.pad and buf[stop : stop + 1] == b"=":
                    stop += 1
            if mode == _RELEASE and form.pad and (e == len(buf) or (stop == len(buf) and stop - e <= form.pad)):
                return start  # the mixed character, or more padding, may follow
            if encoding == "base64":
                encoding = _b64_kind(buf, start, stop)
        hits.append(_Hit(start, stop, start, form.name, encoding, form.value, 0))
        return None

    def _anchor_hit(self, act: _Anchor, buf: bytes, s: int, e: int, mode: int, hits: list[_Hit]) -> int | None:
        pat = self.patterns[act.pattern]
        if act.encoding == "plain":
            return self._plain_anchor(act.pattern, pat, buf, s, mode, hits)
        if act.encoding == "hex":
            return self._hex_anchor(act.pattern, pat, buf, s, mode, hits)
        return self._b64_anchor(act.pattern, pat, act.align, buf, s, mode, hits)

    def _plain_anchor(self, idx: int, pat: LeakPattern, buf: bytes, s: int, mode: int, hits: list[_Hit]) -> int | None:
        end = len(buf)
        m = pat.regex.match(buf, s)
        if mode == _FEED:
            reach = pat.window if m else pat.miss_window
            if s + reach > end and not (m and m.end() + _SLACK <= end):
                return s
        elif mode == _RELEASE and self._anchor_pending(pat, m, buf, s):
            return s
        if m:
            ms, me = _secret_span(m)
            hits.append(_Hit(ms, me, s, pat.kind, "plain", buf[ms:me], 1))
        # Percent-encoded: every anchor is made of unreserved characters, so it survives as is.
        escaped = s >= 3 and buf[s - 3] == 0x25 and buf[s - 2] in _HEX_CHARS and buf[s - 1] in _HEX_CHARS
        if mode == _RELEASE and not escaped:
            # Decoding escapes changes nothing up to the first "%": none up to where the match is
            # settled (or cannot be one), and the URL-decoded reading is the plain one.
            settled = m.end() if m else end
            if m is None and pat.pending is not None:
                pm = pat.pending.match(buf, s)
                settled = pm.end() if pm else s
            if buf.find(b"%", s, settled + 1) < 0:
                return None
        reach = s + 3 * pat.window
        if not escaped and buf.find(b"%", s, reach) < 0 and (mode == _FINAL or reach <= end):
            return None
        run = self._url_run[idx].match(buf, s)
        assert run is not None
        if mode != _FINAL and run.end() == end and run.end() - s < 3 * pat.window:
            return s
        raw = run.group()
        if b"%" not in raw and not escaped:
            return None
        prev = binascii.unhexlify(buf[s - 2 : s]) if escaped else buf[s - 1 : s] if s else b""
        for plus in (False, True) if b"+" in raw else (False,):
            decoded, offsets = _url_decode(raw, plus)
            um = pat.regex.match(prev + decoded, len(prev))
            if um:
                ds, de = (x - len(prev) for x in _secret_span(um))
                hs, he = s + offsets[ds], s + offsets[de]
                enc: Encoding = "url" if b"%" in buf[s:he] or escaped or plus else "plain"
                hits.append(_Hit(hs, he, s, pat.kind, enc, decoded[ds:de], 1))
                break
        return None

    def _hex_anchor(self, idx: int, pat: LeakPattern, buf: bytes, s: int, mode: int, hits: list[_Hit]) -> int | None:
        run = self._hex_run[idx].match(buf, s)
        assert run is not None
        if mode == _FEED and run.end() + 3 > len(buf):  # a line break and more digits may follow
            return s
        if mode == _RELEASE and _BREAK_TAIL.fullmatch(buf, run.end()):
            return s
        prev = b""
        if s >= 2 and buf[s - 2] in _HEX_CHARS and buf[s - 1] in _HEX_CHARS:
            prev = binascii.unhexlify(buf[s - 2 : s])
        digits, where = _unwrap(buf, s, run.end())
        decoded = prev + binascii.unhexlify(digits[: len(digits) // 2 * 2])
        m = pat.regex.match(decoded, len(prev))
        if m:
            ds, de = _secret_span(m)
            hs, he = where(2 * (ds - len(prev))), where(2 * (de - len(prev)))
            hits.append(_Hit(hs, he, s, pat.kind, "hex", decoded[ds:de], 1))
        return None

    def _b64_anchor(
        self, idx: int, pat: LeakPattern, k: int, buf: bytes, s: int, mode: int, hits: list[_Hit]
    ) -> int | None:
        g = s - (0, 2, 3)[k]  # where the anchor's 4-character group starts
        if g < 0 or any(c not in _B64_CHARS for c in buf[g:s]):
            return None
        run = self._b64_run[idx].match(buf, g)
        assert run is not None
        if mode == _FEED and run.end() + 3 > len(buf):  # the run (a line break, "=" padding) may go on
            return g
        if mode == _RELEASE and _B64_RUN_TAIL.fullmatch(buf, run.end()):
            return g
        # One group before, when there is one, gives the regex its lookbehind byte.
        first = g - 4 if g >= 4 and all(c in _B64_CHARS for c in buf[g - 4 : g]) else g
        chars, where = _unwrap(buf, first, run.end())
        decoded = _b64_decode(chars.translate(_URLSAFE_TO_STD))
        m = pat.regex.match(decoded, (g - first) // 4 * 3 + k)
        if m:
            ds, de = _secret_span(m)
            # The character before the token mixes in bits of its anchor only (public): it stays.
            hs = where(-(-8 * ds // 6) if ds == m.start() else 8 * ds // 6)
            he = where(min(-(-8 * de // 6), len(chars)))
            if he == run.end():
                while he - run.end() < 2 and buf[he : he + 1] == b"=":
                    he += 1
            hits.append(_Hit(hs, he, g, pat.kind, _b64_kind(buf, hs, he), decoded[ds:de], 1))
        return None

    def _probe(self, data: bytes, lo: int, hi: int) -> list[tuple[LeakPattern, int, int, bytes, int]]:
        """Matches of the unanchored patterns starting in [lo, hi): (pattern, span, value, start)."""
        shape = data.translate(_T_PROBE)
        out = []
        for _, pat in self._probed:
            starts: set[int] = set()
            for needle, back in pat.probes:
                h = shape.find(needle, lo)
                while h >= 0:
                    starts.update(range(max(h - back, lo), min(h + 1, hi)))
                    h = shape.find(needle, h + 1)
            for t in sorted(starts):
                m = pat.regex.match(data, t)
                if m:
                    ms, me = _secret_span(m)
                    out.append((pat, ms, me, data[ms:me], t))
        return out

    def _long_runs(self, buf: bytes, lo: int, base: int, mode: int, hits: list[_Hit]) -> int:
        """Unanchored patterns inside long base64 or hex runs, decoded window by window.

        Windows start at a run's start and at every stream offset divisible by _STEP inside it,
        so which windows exist does not depend on the chunking; those starting at ``lo`` or later
        are decoded (a window a cut went through is decoded again, whole, the round after).
        Returns the cut limit: the first window the buffer does not yet hold whole -- in release
        mode, the end of the last run whose decoding may still become a token."""
        end = len(buf)
        limit = end
        shape = buf.translate(_T_B64)
        if mode != _FINAL and end and shape[end - 1] == 0x61:  # the buffer ends inside a run
            run_start = shape.rfind(b" ") + 1
            if mode == _RELEASE:
                limit = _encoded_tail(buf, run_start, end, base)
            elif run_start >= lo and (run_start or not base) and run_start + _SEG > end:
                limit = run_start
            else:
                x = max(run_start + 1, lo, end - _SEG + 1)
                x += -(base + x) % _STEP
                limit = min(limit, x)
        needle = b"a" * _B64_MINRUN
        runs: list[tuple[int, int]] = []
        pos, dense = lo, False
        while (p := shape.find(needle, pos)) >= 0:
            run_end = shape.find(b" ", p)
            pos = run_end = end if run_end < 0 else run_end
            runs.append((shape.rfind(b" ", 0, p) + 1, run_end))
            if len(runs) == 8 and sum(b - a for a, b in runs) * 2 > run_end - runs[0][0]:
                dense = True  # a dump of them: stop looping over runs here
                break
        if not runs:
            return limit
        if dense:  # one slice from the first run to the end of the last
            last_end = shape.find(b" ", shape.rfind(needle))
            candidates = buf[max(runs[0][0], lo) : end if last_end < 0 else last_end]
        else:  # only the runs' characters
            candidates = b" ".join(buf[max(a, lo) : b] for a, b in runs)
        if not self._token_shaped(candidates):
            return limit
        while (p := shape.find(needle, pos)) >= 0:
            run_end = shape.find(b" ", p)
            pos = run_end = end if run_end < 0 else run_end
            runs.append((shape.rfind(b" ", 0, p) + 1, run_end))
        for run_start, run_end in runs:
            # A run reaching back to the buffer's first byte began before it: its start is unknown.
            known = run_start > 0 or base == 0
            starts = [run_start] if known and run_start >= lo else []
            first = max(run_start + 1, lo)
            first += -(base + first) % _STEP
            starts.extend(range(first, run_end, _STEP))
            for x in starts:
                if not (mode != _FEED or run_end < end or x + _SEG <= end):
                    break  # the limit keeps it back
                stop = min(x + _SEG, run_end)
                if stop - x >= _B64_MINRUN:
                    self._decode_window(buf, x, stop, hits)
        return limit

    def _token_shaped(self, runs: bytes) -> bool:
        """Whether any window of these runs could decode to an unanchored token: their characters
        decoded as one stream at each alignment hold every window's decoding, so no probe shape
        there means no token in any window. C speed, no loop over windows."""
        b64 = runs.translate(_URLSAFE_TO_STD, _NOT_B64)
        hexd = runs.translate(None, _NOT_HEX)
        streams = [_b64_decode(b64[a:]) for a in range(4)]
        streams += [binascii.unhexlify(hexd[a : a + (len(hexd) - a) // 2 * 2]) for a in (0, 1)]
        shape = b"\n".join(streams).translate(_T_PROBE)
        return any(shape.find(needle) >= 0 for _, p in self._probed for needle, _ in p.probes)

    def _decode_window(self, buf: bytes, x: int, stop: int, hits: list[_Hit]) -> None:
        """Probe one window of a long run, decoded as base64 at its 4 alignments and as hex."""
        window = buf[x:stop]
        norm = window.translate(_URLSAFE_TO_STD)
        # (text offset of the first decoded byte, characters per byte x 3, decoded bytes, kind)
        pieces: list[tuple[int, int, bytes, Encoding]] = [(x + a, 4, _b64_decode(norm[a:]), "base64") for a in range(4)]
        for run in _HEX_RUN.finditer(window):
            for a in (0, 1):
                digits = run.group()[a:]
                pieces.append((x + run.start() + a, 6, binascii.unhexlify(digits[: len(digits) // 2 * 2]), "hex"))
        # One probe over all decodings joined: a newline cannot be inside a token, nor pass a lookbehind.
        joined = b"\n".join(p[2] for p in pieces)
        found = self._probe(joined, 0, len(joined))
        if not found:
            return
        offsets = []
        at = 0
        for p in pieces:
            offsets.append(at)
            at += len(p[2]) + 1
        for pat, ds, de, value, _ in found:
            i = bisect.bisect_right(offsets, ds) - 1
            origin, width, _, kind = pieces[i]
            ds, de = ds - offsets[i], de - offsets[i]
            hs, he = origin + width * 2 * ds // 6, origin + -(-width * 2 * de // 6)
            enc = _b64_kind(buf, hs, he) if kind == "base64" else kind
            hits.append(_Hit(hs, he, x, pat.kind, enc, value, 1))


class StreamScrubber:
    """Scrubs one output stream: ``feed`` chunks (``release`` when it goes idle), then ``flush``
    once.

    The concatenated output equals ``Scrubber.scrub_bytes`` of the concatenated input, whatever
    the chunking and wherever the releases; each piece returned ends on a UTF-8 character boundary
    (for valid UTF-8). Only the tail that a match could still need is held back (see the module
    doc). ``findings`` collects every hit so far, with offsets in the input stream. Under
    ``block`` a hit raises SecretLeakBlocked before any of the output it was in is returned, and
    the stream stays failed.
    """

    def __init__(self, scrubber: Scrubber) -> None:
        self._scrubber = scrubber
        self._buf = b""
        self._begin = 0  # buf[:begin] was sent: lookbehind context only
        self._base = 0  # stream offset of buf[0]
        self._win = 0  # stream offset where the next round's base64 windows may start (<= begin)
        self._done = False
        self._blocked: SecretLeakBlocked | None = None
        self.findings: list[Finding] = []

    def feed(self, chunk: bytes) -> bytes:
        """Scrub the next chunk; returns what can be sent now (possibly b"")."""
        if self._done:
            raise ValueError("feed() after flush()")
        if self._blocked is not None:
            raise self._blocked
        if not chunk:
            return b""
        self._buf += bytes(chunk)
        return self._emit(final=False)

    def release(self) -> bytes:
        """What is held back, scrubbed, except what could still be the beginning of a secret: for
        a stream gone idle, so live output is not delayed, while a secret written in parts with a
        pause between them is still caught whole. What stays held is bounded (a pattern's maximal
        length, a known secret's longest encoded form, a base64 window) and goes out with the
        next bytes that settle it, or scrubbed at ``flush``."""
        if self._blocked is not None:
            raise self._blocked
        if self._done or len(self._buf) == self._begin:
            return b""
        return self._emit(final=False, release=True)

    @property
    def held(self) -> int:
        """How many bytes fed are not returned yet."""
        return len(self._buf) - self._begin

    def _flush_all(self, data: bytes) -> bytes:
        # One pass over a whole input: what scrub_bytes is, and what streaming must equal.
        self._buf = data
        return self.flush()

    def flush(self) -> bytes:
        """The rest of the stream, scrubbed; the stream is finished."""
        if self._blocked is not None:
            raise self._blocked
        if self._done:
            return b""
        self._done = True
        return self._emit(final=True)

    def _emit(self, final: bool, release: bool = False) -> bytes:
        sc, buf, begin = self._scrubber, self._buf, self._begin
        if not final and not release and len(buf) - begin <= sc._hold:
            return b""
        done = sc._round(buf, begin, self._base, final, release, max(self._win - self._base, 0))
        cut = done.cut
        new = [sc._finding(r, self._base) for r in done.regions]
        if new and sc.action is LeakAction.BLOCK:
            self._blocked = SecretLeakBlocked(new[0])
            self.findings.extend(new[:1])
            raise self._blocked
        self.findings.extend(new)
        if sc.action is LeakAction.WARN or not done.regions:
            out = buf[begin:cut]
        else:
            parts: list[bytes] = []
            pos = begin
            for start, stop, hit in done.regions:
                parts += (buf[pos:start], b"[REDACTED:%s]" % hit.kind.encode())
                pos = stop
            parts.append(buf[pos:cut])
            out = b"".join(parts)
        # Kept before the cut: the base64 window it is in (decoded again, whole), escapes (whole,
        # and what a view looks behind them for), the start of a line of base64 (a wrapped one?).
        win = _window_start(buf, cut, self._base) if sc._probed else cut
        ctx = _CTX
        if done.escapes:
            lo = max(cut - _ESC_CTX, 0)
            if buf.find(b"\x1b", lo, cut) >= 0 or buf.find(b"\\", lo, cut) >= 0:
                ctx = _ESC_CTX
        keep = max(min(cut - ctx, win - 1, _line_start(buf, cut)), 0)
        self._buf = buf[keep:]
        self._begin = cut - keep
        self._base += keep
        self._win = self._base + win - keep
        return out


# -- helpers ------------------------------------------------------------------------------------


def _wrapped_run(char: bytes, bound: int) -> re.Pattern[bytes]:
    """Up to ``bound`` characters of class ``char``, line breaks between them allowed."""
    return re.compile(rb"(?:%s|\r?\n(?=%s)){0,%d}" % (char, char, bound))


def _unwrap(buf: bytes, start: int, stop: int) -> tuple[bytes, Callable[[int], int]]:
    """``buf[start:stop]`` without line breaks, and a map from an offset in that to one in buf."""
    text = buf[start:stop]
    if b"\n" not in text:
        return text, lambda i: start + i
    kept = [start + i for i, c in enumerate(text) if c not in b"\r\n"] + [stop]
    return text.replace(b"\r", b"").replace(b"\n", b""), kept.__getitem__


def _window_start(buf: bytes, cut: int, base: int) -> int:
    """The first base64 window (see Scrubber._long_runs) that holds the byte before ``cut`` and
    goes on past it -- the next round decodes it again, whole; ``cut`` when no run goes through."""
    if cut == 0 or buf[cut - 1] not in _B64_CHARS:
        return cut
    lo = max(cut - _SEG - 8, 0)
    space = buf[lo:cut].translate(_T_B64).rfind(b" ")
    if space >= 0 or (lo == 0 and base == 0):
        run_start = lo + space + 1
        if run_start + _SEG > cut:
            return run_start
    x = cut - _SEG + 1
    x += -(base + x) % _STEP
    return min(x, cut)


def _line_start(buf: bytes, cut: int) -> int:
    """Where the line the cut is in starts (its line break, kept for the wrapped-base64 view),
    if that line is all base64 up to the cut and not too long to be a wrapped one; else ``cut``."""
    if cut == 0 or buf[cut - 1] not in _B64_CHARS:
        return cut
    nl = buf.rfind(b"\n", max(cut - _LINE_CTX, 0), cut)
    if nl < 0 or buf[nl + 1 : cut].translate(None, _NOT_B64) != buf[nl + 1 : cut]:
        return cut
    return nl


def _encoded_tail(buf: bytes, run_start: int, end: int, base: int) -> int:
    """Where the end of the base64 (or hex) run ``buf[run_start:end]`` may hold the beginning of
    an encoded unanchored token's redacted part: its decoding (at any alignment) ends in token
    bytes from a place where a Discord token may start ("M", "N" or "O" after a byte that is not a
    word character, or first in a window's decoding) or a Telegram token's secret may (after ":"
    or "%3A"); a character not yet decoded into a whole byte counts when its bits allow it."""
    start = max(run_start, end - 128)
    chars = buf[start:end].translate(_URLSAFE_TO_STD)
    # where a window's decoding begins (see Scrubber._long_runs): nothing before it to look behind
    fresh = {x for x in range(start - (base + start) % _STEP, end, _STEP) if x >= start}
    if run_start == start and (run_start or not base):
        fresh.add(run_start)
    hold = end
    for a in range(4):
        bits = 6 * (len(chars) - a)
        if bits <= 0:
            continue
        known = chars[-1:].translate(_B64_VALUE)[0] & ((1 << bits % 8) - 1) if bits % 8 else None
        decoded = _b64_decode(chars[a:])
        firsts = {(x + i - start - a) // 4 * 3 for x in fresh for i in range(4) if (x + i - start - a) % 4 == 0}
        p = _token_start(decoded, known, bits % 8, firsts, start > run_start)
        if p is not None:
            hold = min(hold, start + a + 8 * p // 6)
    m = _HEX_TAIL.search(buf, max(start, end - 192))
    if m and m.end() - m.start() >= 2:
        fresh.add(m.start())
        for a in (0, 1):
            digits = buf[m.start() + a : end]
            odd = len(digits) % 2
            known = int(digits[-1:], 16) if odd else None
            firsts = {(x + i - m.start() - a) // 2 for x in fresh for i in range(2) if (x + i - m.start() - a) % 2 == 0}
            decoded = binascii.unhexlify(digits[: len(digits) - odd])
            p = _token_start(decoded, known, 4 * odd, firsts, m.start() > start or start > run_start)
            if p is not None:
                hold = min(hold, m.start() + a + 2 * p)
    return hold


_B64_VALUE = bytes.maketrans(_B64_STD, bytes(range(64)))


def _token_start(decoded: bytes, known: int | None, nbits: int, fresh: set[int], cut_short: bool) -> int | None:
    """The first offset in ``decoded`` from which every byte is a token byte and a token's
    redacted part may start (``len(decoded)``: the byte of which only the top ``nbits`` are known,
    ``known``); None if there is none. ``fresh``: offsets a decoding starts at (no lookbehind);
    ``cut_short``: the decoded bytes do not begin where the run does (anything may precede)."""
    n = len(decoded)
    for p in range(len(decoded.rstrip(_TOKEN_BYTES)), n + 1):
        if p == 0 and cut_short:
            return 0
        prev = decoded[p - 1] if p else None
        after_colon = prev == 0x3A or decoded[max(p - 3, 0) : p] in (b"%3A", b"%3a")
        open_before = p in fresh or prev is None or prev not in _WORD_SET
        if p == n:
            if known is None:
                return None
            return p if after_colon or (open_before and known == 0x4C >> (8 - nbits)) else None
        if after_colon or (open_before and decoded[p] in b"MNO"):
            return p
    return None


_WORD_SET = frozenset(_WORD)


def _lower_escapes(url: str) -> str:
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), url)


def _secret_span(m: re.Match[bytes]) -> tuple[int, int]:
    return m.span("secret") if "secret" in m.re.groupindex else m.span()


def _b64_decode(chars: bytes) -> bytes:
    """Standard-alphabet base64 without padding; a last partial group gives its whole bytes."""
    whole, rest = len(chars) // 4 * 4, len(chars) % 4
    padded = chars[:whole] + (chars[whole:] + b"=" * (4 - rest) if rest >= 2 else b"")
    return binascii.a2b_base64(padded)


def _b64_kind(buf: bytes, start: int, end: int) -> Encoding:
    return "base64url" if b"-" in buf[start:end] or b"_" in buf[start:end] else "base64"


def _probe_encoding(buf: bytes, start: int, end: int) -> Encoding:
    return "url" if b"%" in buf[start:end] else "plain"


def _url_decode(raw: bytes, plus: bool) -> tuple[bytes, list[int]]:
    """Percent-decoded ``raw`` and, for each decoded byte (and the end), its offset in ``raw``."""
    out = bytearray()
    offsets = []
    i = 0
    while i < len(raw):
        offsets.append(i)
        c = raw[i]
        if c == 0x25 and i + 2 < len(raw) and raw[i + 1] in _HEX_CHARS and raw[i + 2] in _HEX_CHARS:
            out += binascii.unhexlify(raw[i + 1 : i + 3])
            i += 3
            continue
        out.append(0x20 if plus and c == 0x2B else c)
        i += 1
    offsets.append(i)
    return bytes(out), offsets


def _merge(hits: list[_Hit]) -> list[tuple[int, int, _Hit]]:
    """Overlapping hits become one region, named by its longest hit (a known secret wins a tie)."""
    hits.sort(key=lambda h: (h.start, -h.end))
    regions: list[tuple[int, int, _Hit]] = []
    for h in hits:
        if regions and h.start < regions[-1][1]:
            start, stop, best = regions[-1]
            if _preference(h) < _preference(best):
                best = h
            regions[-1] = (start, max(stop, h.end), best)
        else:
            regions.append((h.start, h.end, h))
    return regions


def _preference(h: _Hit) -> tuple[int, int, int, str]:
    return (h.start - h.end, h.rank, h.start, h.kind)


def _utf8_cut(buf: bytes, cut: int) -> int:
    """``cut``, moved back to the start of the UTF-8 character it would split."""
    lead = cut
    while lead > 0 and cut - lead < 3 and buf[lead - 1] & 0xC0 == 0x80:
        lead -= 1
    if lead == 0:
        return cut
    c = buf[lead - 1]
    need = 2 if 0xC0 <= c < 0xE0 else 3 if 0xE0 <= c < 0xF0 else 4 if 0xF0 <= c < 0xF8 else 1
    return lead - 1 if cut - (lead - 1) < need else cut


def _char_offsets(data: bytes, findings: list[Finding]) -> list[Finding]:
    """Findings (in order, not overlapping) with byte offsets into ``data`` made character offsets."""
    out = []
    byte = char = 0
    for f in findings:
        char += len(data[byte : f.start].decode("utf-8", "surrogatepass"))
        end = char + len(data[f.start : f.end].decode("utf-8", "surrogatepass"))
        out.append(f.model_copy(update={"start": char, "end": end}))
        byte, char = f.end, end
    return out


_DEFAULT: Scrubber | None = None


def _default() -> Scrubber:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Scrubber({})
    return _DEFAULT


def scan_text(text: str, secrets: Mapping[str, str] | None = None) -> list[Finding]:
    """Findings in ``text`` (character offsets): the patterns, plus ``secrets`` when given."""
    return (Scrubber(secrets) if secrets else _default()).scan_text(text)


def scrub_bytes(data: bytes, secrets: Mapping[str, str] | None = None) -> tuple[bytes, list[Finding]]:
    """``data`` with every pattern match (and ``secrets``, when given) redacted, and the findings."""
    return (Scrubber(secrets) if secrets else _default()).scrub_bytes(data)

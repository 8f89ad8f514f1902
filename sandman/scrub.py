"""Secret scrubbing and leak detection for everything a sandboxed command prints.

Two kinds of secrets are caught, plain and encoded (base64 standard and URL-safe, with or without
padding; URL percent-encoding; hex in either case):

* known secrets, given by name and value (the operator's own keys): every occurrence becomes
  ``[REDACTED:<name>]``. Values shorter than ``MIN_SECRET_LEN`` (4) characters are ignored: they
  would match all over ordinary output. When known values overlap, the longest match wins.
* credentials sandman was not told about, found by ``PATTERNS`` (OpenAI, Anthropic, OpenRouter,
  GitHub, GitLab, Google, AWS, Slack, Discord, Telegram, Stripe, PEM private keys): each becomes
  ``[REDACTED:<kind>]``, or blocks the output, or is only reported (``LeakAction``).

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
then also takes the one mixed character on each side (and the ``=`` padding) when present, so no
bit of the secret is left behind. From an encoded anchor, decoding follows line breaks, so a
private key run through ``base64`` (76 columns) or ``xxd -p`` is redacted whole.

Streaming (``Scrubber.stream()``) gives exactly the bytes that scrubbing the whole input at once
gives: chunking never matters. It holds back only what a match may still need: the longest needle
plus 4 bytes, 128 bytes for the unanchored patterns, the current window (up to 512 bytes) inside a
long base64 run, and from an anchor seen near the end up to that pattern's bound -- every pattern's
token is at most ``MAX_TOKEN`` (512) bytes (of a longer run, the first 512 are redacted), a PEM key
body at most ``PEM_MAX_BODY`` (16 KiB; a key without its END line is redacted up to the first
character that cannot be in one) -- and it never splits a multi-byte UTF-8 character.

Not caught: a known secret split by a line break inside wrapped base64; encodings nested in
encodings (base64 of hex, ...); JSON ``\\u`` escapes; hex in mixed case.
"""

from __future__ import annotations

import binascii
import bisect
import hashlib
import hmac
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
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
_CTX = 16  # bytes kept before the unsent data, for lookbehinds and base64 groups
_BACK = 4  # how far before its needle a hit may start (base64 groups, mixed characters)
_PROBE_HOLD = 128  # longest unanchored token (Discord: 73 bytes) plus lookarounds, rounded up
_B64_MINRUN = 56  # shortest base64 run that can hold an unanchored token (Telegram: 44 bytes)
_HEX_MINRUN = 88  # the same for hex
_SEG = 512  # long base64 runs are decoded in windows of this size...
_STEP = 256  # ...starting every STEP characters: any token (<= 100 encoded chars) fits one window

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


Encoding = Literal["plain", "base64", "base64url", "url", "hex"]


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
    lets the many false anchors ("task-", "disk-") be dropped before any regex runs."""

    kind: str
    regex: re.Pattern[bytes]
    anchors: tuple[bytes, ...] = ()
    probes: tuple[tuple[bytes, int], ...] = ()
    window: int = MAX_TOKEN + _SLACK  # furthest a successful match attempt reads past its start
    # ...and one that fails: the fixed start, the minimum count, lookarounds (at most ~80 here)
    miss_window: int = _SLACK
    boundary: frozenset[int] = frozenset()


_WORD = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"
# Most keys follow a word boundary; so do a JSON escape ("\nsk-...") and a URL escape ("%3Dsk-...").
_ESCAPED = rb"(?<=\\[nrt])|(?<=%[0-9A-Fa-f]{2})"
_B = rb"(?:(?<![A-Za-z0-9_-])|" + _ESCAPED + rb")"
_PEM_HEAD = rb"-----BEGIN[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----"
_PEM_BODY = rb"(?:[A-Za-z0-9+/=\s:,.]|\\[nrt]|-(?!----)){0,%d}" % PEM_MAX_BODY
_PEM_TAIL = rb"(?:-----END[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----)?"


def _p(
    kind: str,
    regex: bytes,
    anchors: Iterable[str],
    window: int = MAX_TOKEN + _SLACK,
    boundary: bytes = b"",
) -> LeakPattern:
    return LeakPattern(
        kind, re.compile(regex), tuple(a.encode() for a in anchors), (), window, _SLACK, frozenset(boundary)
    )


PATTERNS: tuple[LeakPattern, ...] = (
    _p(
        "openai",
        _B + rb"sk-(?:(?:proj|svcacct|admin)-[A-Za-z0-9_-]{20,480}|[A-Za-z0-9]{20,480})",
        ["sk-"],
        boundary=_WORD,
    ),
    _p("anthropic", _B + rb"sk-ant-[A-Za-z0-9_-]{20,480}", ["sk-ant-"], boundary=_WORD),
    _p("openrouter", _B + rb"sk-or-v1-[A-Za-z0-9]{32,480}", ["sk-or-v1-"], boundary=_WORD),
    _p("github", rb"gh[pousr]_[A-Za-z0-9]{36,251}", ["ghp_", "gho_", "ghu_", "ghs_", "ghr_"]),
    _p("github", rb"github_pat_[A-Za-z0-9_]{22,244}", ["github_pat_"]),
    _p("gitlab", rb"glpat-[A-Za-z0-9_-]{20,250}", ["glpat-"]),
    _p("google_api", rb"AIza[0-9A-Za-z_-]{35}", ["AIza"]),
    _p(
        "aws_access_key",
        rb"(?:(?<![A-Z0-9])|" + _ESCAPED + rb")(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])",
        ["AKIA", "ASIA"],
        boundary=_WORD[:26] + _WORD[52:62],
    ),
    _p(
        "aws_secret_key",
        rb"(?i:secret[_-]?access[_-]?key)[\"']?\s{0,8}[:=]{1,2}\s{0,8}[\"']?"
        rb"(?P<secret>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+])",
        [
            "secret_access_key",
            "SECRET_ACCESS_KEY",
            "Secret_Access_Key",
            "secretAccessKey",
            "SecretAccessKey",
            "secret-access-key",
        ],
    ),
    _p("slack", rb"xox[abpr]-[A-Za-z0-9-]{10,250}", ["xoxa-", "xoxb-", "xoxp-", "xoxr-"]),
    _p("slack", rb"xapp-[A-Za-z0-9-]{20,250}", ["xapp-"]),
    _p(
        "stripe",
        rb"(?:sk|rk)_live_[A-Za-z0-9]{16,247}|sk_test_[A-Za-z0-9]{16,247}",
        ["sk_live_", "rk_live_", "sk_test_"],
    ),
    _p(
        "private_key",
        _PEM_HEAD + _PEM_BODY + _PEM_TAIL,
        ["-----BEGIN"],
        window=PEM_MAX_BODY + 200 + _SLACK,
    ),
    LeakPattern(
        "discord",
        re.compile(
            _B + rb"[MNO][A-Za-z0-9_-]{23,25}\.[A-Za-z0-9_-]{6}\.[A-Za-z0-9_-]{27,38}"
            rb"(?![A-Za-z0-9_-])"
        ),
        probes=((b"a" * 23 + b".aaaaaa." + b"a" * 27, 3),),
    ),
    LeakPattern(
        "telegram",
        re.compile(rb"(?:(?<![0-9])|" + _ESCAPED + rb")[0-9]{8,10}(?::|%3[Aa])[A-Za-z0-9_-]{35}(?![A-Za-z0-9_-])"),
        probes=((b"a" * 8 + b":" + b"a" * 35, 2), (b"a" * 8 + b"%" + b"a" * 37, 2)),
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
_HEX_CHARS = frozenset(b"0123456789abcdefABCDEF")
_T_PROBE = _shape_table(_WORD, b":%.")  # the separators the probes look for stay
_T_B64 = _shape_table(_WORD + b"+/")
_STD_TO_URLSAFE = bytes.maketrans(b"+/", b"-_")
_URLSAFE_TO_STD = bytes.maketrans(b"-_", b"+/")
_NOT_B64 = bytes(c for c in range(256) if c not in _B64_CHARS)
_NOT_HEX = bytes(c for c in range(256) if c not in _HEX_CHARS)
_HEX_RUN = re.compile(rb"[0-9a-fA-F]{%d,}" % _HEX_MINRUN)


# -- what a needle in the automaton stands for ------------------------------------------------


@dataclass(frozen=True)
class _SecretForm:
    name: str
    value: bytes
    encoding: Encoding
    lext: bool = False  # base64: a mixed character may precede the core
    pad: int = 0  # base64: a mixed character (and up to ``pad`` "=") may follow the core


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
        for i, pat in enumerate(self.patterns):
            for anchor in pat.anchors:
                add(anchor, _Anchor(i, "plain"))
                add(anchor.hex().encode(), _Anchor(i, "hex"))
                add(anchor.hex().upper().encode(), _Anchor(i, "hex"))
                for k, core in _b64_cores(anchor):
                    for variant in {core, core.translate(_STD_TO_URLSAFE)}:
                        add(variant, _Anchor(i, "base64", k))
        needles = self._needles = list(actions)
        self._actions = [actions[n] for n in needles]
        # Per needle, the bytes before it that rule out every one of its actions (see boundary).
        self._ruled_out: list[frozenset[int]] = []
        for acts in self._actions:
            ruled: frozenset[int] | None = None
            for a in acts:
                plain = isinstance(a, _Anchor) and a.encoding == "plain"
                bound = self.patterns[a.pattern].boundary if isinstance(a, _Anchor) and plain else frozenset()
                ruled = bound if ruled is None else ruled & bound
            self._ruled_out.append(ruled or frozenset())
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
        longest = max((len(n) for n in needles), default=0)
        # What must stay unsent at the end of the buffer whatever was found there.
        self._hold = max(longest + _BACK if needles else 0, _PROBE_HOLD if self._probed else 0)

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

    def _round(self, buf: bytes, begin: int, base: int, final: bool) -> _Round:
        """Find what ``buf[begin:]`` holds and how much of it can be sent.

        ``buf[:begin]`` was sent already (kept for lookbehinds); ``base`` is ``buf[0]``'s offset in
        the stream. Every hit is a function of the bytes around its trigger only, so a hit whose
        bytes are all here is the same in any chunking; the cut keeps back anything that is not.
        """
        end = len(buf)
        hits: list[_Hit] = []
        limit = end if final else end - self._hold
        if self._index is not None:
            ruled_out = self._ruled_out
            for nid, s, e in self._index.find(buf, begin):
                if s < begin:
                    continue
                ruled = ruled_out[nid]
                # Inline for speed (text like "task-" is full of these): glued to a word, no escape.
                if ruled and s >= 3 and buf[s - 1] in ruled and buf[s - 2] != 0x5C and buf[s - 3] != 0x25:
                    continue
                for act in self._actions[nid]:
                    if isinstance(act, _SecretForm):
                        lim = self._secret_hit(act, buf, s, e, final, hits)
                    else:
                        lim = self._anchor_hit(act, buf, s, e, final, hits)
                    if lim is not None and lim < limit:
                        limit = lim
        if self._probed:
            stop = end if final else end - _PROBE_HOLD
            for pat, ms, me, value, _ in self._probe(buf, begin, stop):
                hits.append(_Hit(ms, me, ms, pat.kind, _probe_encoding(buf, ms, me), value, 1))
            lim = self._long_runs(buf, begin, base, final, hits)
            if lim < limit:
                limit = lim
        if self._allow:
            hits = [h for h in hits if h.value not in self._allow]
        regions = _merge(hits)
        if final:
            return _Round(end, regions)
        cut = max(limit, begin)
        while True:
            new = _utf8_cut(buf, cut)
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
        return _Round(cut, [r for r in regions if r[1] <= cut])

    def _secret_hit(self, form: _SecretForm, buf: bytes, s: int, e: int, final: bool, hits: list[_Hit]) -> int | None:
        start, stop, encoding = s, e, form.encoding
        if encoding == "base64":
            if not final and e + 3 > len(buf):
                return s - 1
            # The characters that mix the secret's first and last bits with its neighbours'.
            if form.lext and s > 0 and buf[s - 1] in _B64_CHARS:
                start = s - 1
            if form.pad and e < len(buf) and buf[e] in _B64_CHARS:
                stop = e + 1
                while stop - e <= form.pad and buf[stop : stop + 1] == b"=":
                    stop += 1
            encoding = _b64_kind(buf, start, stop)
        hits.append(_Hit(start, stop, start, form.name, encoding, form.value, 0))
        return None

    def _anchor_hit(self, act: _Anchor, buf: bytes, s: int, e: int, final: bool, hits: list[_Hit]) -> int | None:
        pat = self.patterns[act.pattern]
        if act.encoding == "plain":
            return self._plain_anchor(act.pattern, pat, buf, s, final, hits)
        if act.encoding == "hex":
            return self._hex_anchor(act.pattern, pat, buf, s, final, hits)
        return self._b64_anchor(act.pattern, pat, act.align, buf, s, final, hits)

    def _plain_anchor(
        self, idx: int, pat: LeakPattern, buf: bytes, s: int, final: bool, hits: list[_Hit]
    ) -> int | None:
        end = len(buf)
        m = pat.regex.match(buf, s)
        reach = pat.window if m else pat.miss_window
        if not final and s + reach > end and not (m and m.end() + _SLACK <= end):
            return s
        if m:
            ms, me = _secret_span(m)
            hits.append(_Hit(ms, me, s, pat.kind, "plain", buf[ms:me], 1))
        # Percent-encoded: every anchor is made of unreserved characters, so it survives as is.
        escaped = s >= 3 and buf[s - 3] == 0x25 and buf[s - 2] in _HEX_CHARS and buf[s - 1] in _HEX_CHARS
        reach = s + 3 * pat.window
        if not escaped and buf.find(b"%", s, reach) < 0 and (final or reach <= end):
            return None
        run = self._url_run[idx].match(buf, s)
        assert run is not None
        if not final and run.end() == end and run.end() - s < 3 * pat.window:
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

    def _hex_anchor(self, idx: int, pat: LeakPattern, buf: bytes, s: int, final: bool, hits: list[_Hit]) -> int | None:
        run = self._hex_run[idx].match(buf, s)
        assert run is not None
        if not final and run.end() + 3 > len(buf):  # a line break and more digits may follow
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
        self, idx: int, pat: LeakPattern, k: int, buf: bytes, s: int, final: bool, hits: list[_Hit]
    ) -> int | None:
        g = s - (0, 2, 3)[k]  # where the anchor's 4-character group starts
        if g < 0 or any(c not in _B64_CHARS for c in buf[g:s]):
            return None
        run = self._b64_run[idx].match(buf, g)
        assert run is not None
        if not final and run.end() + 3 > len(buf):  # the run (a line break, "=" padding) may go on
            return g
        # One group before, when there is one, gives the regex its lookbehind byte.
        first = g - 4 if g >= 4 and all(c in _B64_CHARS for c in buf[g - 4 : g]) else g
        chars, where = _unwrap(buf, first, run.end())
        decoded = _b64_decode(chars.translate(_URLSAFE_TO_STD))
        m = pat.regex.match(decoded, (g - first) // 4 * 3 + k)
        if m:
            ds, de = _secret_span(m)
            hs, he = where(8 * ds // 6), where(min(-(-8 * de // 6), len(chars)))
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

    def _long_runs(self, buf: bytes, begin: int, base: int, final: bool, hits: list[_Hit]) -> int:
        """Unanchored patterns inside long base64 or hex runs, decoded window by window.

        Windows start at a run's start and at every stream offset divisible by _STEP inside it,
        so which windows exist does not depend on the chunking. Returns the cut limit: the first
        window the buffer does not yet hold whole."""
        end = len(buf)
        limit = end
        shape = buf.translate(_T_B64)
        if not final and end and shape[end - 1] == 0x61:  # the buffer ends inside a run
            run_start = shape.rfind(b" ") + 1
            if run_start >= begin and run_start + _SEG > end:
                limit = run_start
            else:
                x = max(run_start + 1, begin, end - _SEG + 1)
                x += -(base + x) % _STEP
                limit = min(limit, x)
        needle = b"a" * _B64_MINRUN
        runs: list[tuple[int, int]] = []
        pos, dense = begin, False
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
            candidates = buf[max(runs[0][0], begin) : end if last_end < 0 else last_end]
        else:  # only the runs' characters
            candidates = b" ".join(buf[max(a, begin) : b] for a, b in runs)
        if not self._token_shaped(candidates):
            return limit
        while (p := shape.find(needle, pos)) >= 0:
            run_end = shape.find(b" ", p)
            pos = run_end = end if run_end < 0 else run_end
            runs.append((shape.rfind(b" ", 0, p) + 1, run_end))
        for run_start, run_end in runs:
            starts = [run_start] if run_start >= begin else []
            first = max(run_start + 1, begin)
            first += -(base + first) % _STEP
            starts.extend(range(first, run_end, _STEP))
            for x in starts:
                if not (final or run_end < end or x + _SEG <= end):
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
    """Scrubs one output stream: ``feed`` chunks, then ``flush`` once.

    The concatenated output equals ``Scrubber.scrub_bytes`` of the concatenated input, whatever
    the chunking; each piece returned ends on a UTF-8 character boundary (for valid UTF-8). Only
    the tail that a match could still need is held back (see the module doc). ``findings``
    collects every hit so far, with offsets in the input stream. Under ``block`` a hit raises
    SecretLeakBlocked before any of the output it was in is returned, and the stream stays failed.
    """

    def __init__(self, scrubber: Scrubber) -> None:
        self._scrubber = scrubber
        self._buf = b""
        self._begin = 0  # buf[:begin] was sent: lookbehind context only
        self._base = 0  # stream offset of buf[0]
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
        """Everything held back, scrubbed, with the stream kept open: for a stream gone idle, so
        live output is not delayed. A secret split across such a pause can no longer be matched
        whole (its first part is already out): the price of prompt output, taken only when idle."""
        if self._blocked is not None:
            raise self._blocked
        if self._done or len(self._buf) == self._begin:
            return b""
        return self._emit(final=True)

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

    def _emit(self, final: bool) -> bytes:
        sc, buf, begin = self._scrubber, self._buf, self._begin
        if not final and len(buf) - begin <= sc._hold:
            return b""
        done = sc._round(buf, begin, self._base, final)
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
        keep = max(cut - _CTX, 0)
        self._buf = buf[keep:]
        self._begin = cut - keep
        self._base += keep
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

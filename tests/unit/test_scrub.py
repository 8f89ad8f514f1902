"""Secret scrubbing: every pattern and known secret, plain and encoded, whole or streamed in
any chunking, next to multi-byte characters; near-misses stay; the actions and the allowlist."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable
from functools import cache
from urllib.parse import quote, quote_plus

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandman.errors import SandmanError
from sandman.secrets.scrub import (
    EXAMPLE_KEYS,
    MIN_SECRET_LEN,
    PATTERNS,
    PEM_MAX_BODY,
    Finding,
    LeakAction,
    Scrubber,
    SecretLeakBlocked,
    _b32_cores,
    _b64_cores,
    scan_text,
    scrub_bytes,
)

try:
    import ahocorasick_rs  # noqa: F401

    ENGINES = ["aho-corasick", "regex"]
except ImportError:
    ENGINES = ["regex"]


@cache
def scrubber(
    secrets: tuple[tuple[str, str], ...] = (),
    patterns: bool = True,
    action: LeakAction = LeakAction.REDACT,
    allow: tuple[str, ...] = (),
    engine: str = "auto",
) -> Scrubber:
    return Scrubber(dict(secrets), patterns, allow, action, engine=engine)  # type: ignore[arg-type]


def streamed(
    sc: Scrubber, data: bytes, cuts: list[int], pauses: Iterable[int] = ()
) -> tuple[bytes, list[Finding], list[bytes]]:
    """Feed ``data`` cut at ``cuts``, the stream going idle (``release``) after the chunks whose
    index is in ``pauses`` (once per occurrence); returns the output, the findings and each piece
    returned."""
    s = sc.stream()
    pieces = []
    prev = 0
    idle = list(pauses)
    for i, cut in enumerate([*cuts, len(data)]):
        pieces.append(s.feed(data[prev:cut]))
        prev = cut
        pieces.extend(s.release() for _ in range(idle.count(i)))
    pieces.append(s.flush())
    return b"".join(pieces), s.findings, pieces


# -- every pattern, plain and in every encoding --------------------------------------------------

PEM_RSA = (
    "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM9Oi+/uX0Lz0yCw==\n"
    "q8Lm2Np4Rt6Vw8Xy0Za2Bc4De6Fg8Hi0Jk2Lm4No6Pq8Rs0Tu2Vw4Xy6Za8=\n-----END RSA PRIVATE KEY-----"
)
PEM_OPENSSH = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
    "QyNTUxOQAAACDk3m0kZ9yT1QxW7bqf5y8cR2aV0Y5uUjv3X4L0yq9lJwAAAJg=\n-----END OPENSSH PRIVATE KEY-----"
)
PEM_ENCRYPTED = (
    "-----BEGIN EC PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,0123456789ABCDEF\n\n"
    "MHcCAQEEIBkg4LVWM9nuwNSk3yByxZpYRTBnVJk5oVVYqL9l5Yr7oAoGCCqGSM49\n-----END EC PRIVATE KEY-----"
)
AWS_SECRET = "Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MGFiY2RlZmdo"

# (kind, text as it would appear, the part that must disappear)
PATTERN_CASES: list[tuple[str, str, str]] = [
    ("openai", "sk-" + "Ab3dE5gH7jK9" * 4, ""),
    ("openai", "sk-proj-" + "Ab3dE5gH7j_K9-Lm" * 5, ""),
    ("openai", "sk-svcacct-" + "Qw3eRt5yUi7oP9aS" * 3, ""),
    ("anthropic", "sk-ant-api03-" + "Xy7_Qz-9Rt" * 9 + "AA", ""),
    ("openrouter", "sk-or-v1-" + "0123456789abcdef" * 4, ""),
    ("github", "ghp_" + "A1b2C3d4E5" * 3 + "F6g7H8", ""),
    ("github", "gho_" + "Z9y8X7w6V5" * 3 + "u4T3s2", ""),
    ("github", "ghu_" + "k1L2m3N4o5" * 3 + "P6q7R8", ""),
    ("github", "ghs_" + "Q1w2E3r4T5" * 3 + "y6U7i8", ""),
    ("github", "ghr_" + "M1n2B3v4C5" * 3 + "x6Z7a8", ""),
    ("github", "github_pat_11ABCDEFG0123456789_" + "abcdefghij" * 5 + "ABCDEFGHI", ""),
    ("gitlab", "glpat-xY9_zW8-vU7tS6rQ5pO4", ""),
    ("google_api", "AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q", ""),
    ("aws_access_key", "AKIAZ7QW2ERTYUIOP3LK", ""),
    ("aws_access_key", "ASIAY6PL5OKMNJIUHB4V", ""),
    ("aws_secret_key", f"aws_secret_access_key = {AWS_SECRET}", AWS_SECRET),
    ("aws_secret_key", f'AWS_SECRET_ACCESS_KEY="{AWS_SECRET}"', AWS_SECRET),
    ("aws_secret_key", f'"SecretAccessKey": "{AWS_SECRET}"', AWS_SECRET),
    ("slack", "xoxb-1234567890-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", ""),
    ("slack", "xoxa-2-1234567890-AbCdEfGhIjKl", ""),
    ("slack", "xoxp-1234567890-1234567890-AbCdEfGhIjKl", ""),
    ("slack", "xoxr-1234567890-AbCdEfGhIjKlMnOp", ""),
    ("slack", "xapp-1-A0123456789-1234567890123-" + "abcdef0123456789" * 4, ""),
    ("discord", "MTk4NjIyNDgzNDcxOTI1MjQ4.Cl2FMQ.ZnCjm1XVW7vRze4b7Cq4se7kKWs", ""),
    # the bot id before the colon is public: only the secret after it goes
    ("telegram", "123456789:AAH" + "dQw4w9WgXcQ_abcdefghij-KLMNOPqrs", "AAH" + "dQw4w9WgXcQ_abcdefghij-KLMNOPqrs"),
    ("stripe", "sk_live_4eC39HqLyjWDarjtT1zdp7dc", ""),
    ("stripe", "rk_live_51H8abcdEFGHijklMNOPqrst", ""),
    ("stripe", "sk_test_4eC39HqLyjWDarjtT1zdp7dc", ""),
    ("private_key", PEM_RSA, ""),
    ("private_key", PEM_OPENSSH, ""),
    ("private_key", PEM_ENCRYPTED, ""),
    (
        "private_key",
        "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----",
        "",
    ),
]
ENCODINGS = ["plain", "base64", "base64url", "url", "hex"]
PREFIXES = [b"", b" ", b"x "]  # the token at each offset modulo 3 of a base64 blob


def encode(raw: bytes, encoding: str, prefix: bytes = b"") -> bytes:
    blob = prefix + raw + b"\n"
    if encoding == "base64":
        return base64.b64encode(blob)
    if encoding == "base64url":
        return base64.urlsafe_b64encode(blob).rstrip(b"=")
    if encoding == "hex":
        return blob.hex().encode()
    if encoding == "url":
        return quote(blob, safe="").encode()
    return blob


def traces(secret: bytes) -> list[bytes]:
    """Every form in which ``secret`` could survive an encoding."""
    forms = [secret, secret.hex().encode(), secret.hex().upper().encode(), quote(secret, safe="").encode()]
    for _, core in _b64_cores(secret):
        forms += [core, core.translate(bytes.maketrans(b"+/", b"-_"))]
    return forms


def test_every_pattern_kind_has_a_case() -> None:
    assert {p.kind for p in PATTERNS} == {kind for kind, _, _ in PATTERN_CASES}


@pytest.mark.parametrize("prefix", PREFIXES, ids=["align0", "align1", "align2"])
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize(("kind", "token", "part"), PATTERN_CASES, ids=[f"{k}-{t[:12]}" for k, t, _ in PATTERN_CASES])
def test_pattern_is_caught_in_every_encoding(kind: str, token: str, part: str, encoding: str, prefix: bytes) -> None:
    secret = (part or token).encode()
    data = b"log: " + encode(token.encode(), encoding, prefix) + b" ;done\n"
    out, findings = scrubber().scrub_bytes(data)
    assert [f.kind for f in findings] == [kind], (out, findings)
    assert f"[REDACTED:{kind}]".encode() in out
    for trace in traces(secret):
        assert trace not in out
    f = findings[0]
    expected = encoding.replace("url", "") if encoding.startswith("base64") else encoding
    assert f.encoding.startswith(expected) or (encoding == "url" and f.encoding == "plain")
    assert out.startswith(b"log: ") and out.endswith(b" ;done\n")


@pytest.mark.parametrize(("kind", "token", "part"), PATTERN_CASES, ids=[f"{k}-{t[:12]}" for k, t, _ in PATTERN_CASES])
def test_plain_pattern_replaces_exactly_the_token(kind: str, token: str, part: str) -> None:
    text = f"export X={token}\nnext line"
    out, findings = scrubber().scrub_text(text)
    assert out == text.replace(part or token, f"[REDACTED:{kind}]")
    assert text[findings[0].start : findings[0].end] == (part or token)


@pytest.mark.parametrize("wrap", ["base64", "hex"])
def test_line_wrapped_encoded_private_key_is_redacted_whole(wrap: str) -> None:
    key = PEM_RSA.replace("q8Lm2Np4", "q8Lm2Np4" + "AbCdEfGh" * 300).encode()  # a 2.5 KB body
    if wrap == "base64":
        encoded = base64.encodebytes(key)  # 76 columns, like base64(1)
    else:
        digits = key.hex().encode()
        encoded = b"\n".join(digits[i : i + 60] for i in range(0, len(digits), 60))  # like xxd -p
    data = b"$ encode key.pem\n" + encoded + b"\n$ done\n"
    out, findings = scrubber().scrub_bytes(data)
    assert [(f.kind, f.encoding) for f in findings] == [("private_key", wrap)]
    assert out.startswith(b"$ encode key.pem\n[REDACTED:private_key]") and out.endswith(b"\n$ done\n")
    assert len(out) < 64
    assert streamed(scrubber(), data, list(range(4096, len(data), 4096)))[0] == out


def test_truncated_private_key_is_still_redacted() -> None:
    text = "key:\n" + PEM_RSA.split("-----END")[0] + "(output truncated)"
    out, findings = scrubber().scrub_text(text)
    assert [f.kind for f in findings] == ["private_key"]
    assert "MIIEpAIBAAKCAQEA" not in out and out.endswith("(output truncated)")


def test_json_escaped_newlines_keep_a_key_whole() -> None:
    text = '{"log": "line\\nsk-proj-' + "Ab3dE5gH7j_K9-Lm" * 3 + '\\nmore"}'
    out, findings = scrubber().scrub_text(text)
    assert [f.kind for f in findings] == ["openai"] and "Ab3dE5gH7j" not in out


NEAR_MISSES = [
    "sk-abc123",  # too short
    "sk-proj-short_one",
    "sk-ant-api03-tooShort",
    "ghp_" + "a1B2c3D4" * 3,  # 24 of 36
    "glpat-short",
    "AIzaSyA1b2C3d4E5f6G7h8",
    "AKIAZ7QW2ERTYUIOP3L",  # 15 of 16
    "AKIAz7qw2ertyuiop3lk",  # lower case
    "XAKIAZ7QW2ERTYUIOP3LKX",  # inside a longer upper-case word
    "xoxb-short",
    "12345:AAH" + "x" * 32,  # too few digits
    "sk_live_short",
    "the skeleton key skipped a task-management-service-configuration step",
    "my-disk-0123456789abcdefghijklmnop",
    "aws_secret_access_key = tooShortValue",
    "-----BEGIN CERTIFICATE-----\nMIIDdzCCAl+gAwIBAgIEAgAAuTANBgkqhkiG9w0BAQUFADBaMQswCQYDVQQGEwJJ\n-----END CERTIFICATE-----",
    "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n-----END PUBLIC KEY-----",
    "commit 3f786850e387550fdab836ed7e6dc881de23001b",
    "sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "id 123e4567-e89b-12d3-a456-426614174000 at 2024-05-01T12:00:00.000Z",
    "data: " + base64.b64encode(bytes(range(256))).decode(),
    "MTk4NjIyNDgzNDcxOTI1MjQ4.Cl2FMQ",  # a Discord-looking fragment
    "os.path.join(self.cache_dir, 'pkg-resources-1.2.3.tar.gz')",
]


@pytest.mark.parametrize("text", NEAR_MISSES)
def test_near_misses_are_left_alone(text: str) -> None:
    assert scan_text(text) == []
    assert scrub_bytes(text.encode()) == (text.encode(), [])


# -- known secrets -------------------------------------------------------------------------------

SECRET = "p@ss:w0rd/+ Secret?~"  # URL-special characters and a space; base64 with + and /
SECRETS = (("db", SECRET), ("api", "tok_9f8e7d6c5b4a"))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("prefix", [b"", b"a", b"ab", b"abc"], ids=["p0", "p1", "p2", "p3"])
@pytest.mark.parametrize(
    "form",
    ["plain", "b64", "b64-nopad", "b64url", "b64url-nopad", "url", "url-lower", "url-plus", "hex", "HEX"],
)
def test_known_secret_is_caught_in_every_form(form: str, prefix: bytes, engine: str) -> None:
    raw = prefix + SECRET.encode()
    encoded = {
        "plain": raw,
        "b64": base64.b64encode(raw),
        "b64-nopad": base64.b64encode(raw).rstrip(b"="),
        "b64url": base64.urlsafe_b64encode(raw),
        "b64url-nopad": base64.urlsafe_b64encode(raw).rstrip(b"="),
        "url": quote(raw, safe="").encode(),
        "url-lower": re.sub(rb"%[0-9A-F]{2}", lambda m: m.group().lower(), quote(raw, safe="").encode()),
        "url-plus": quote_plus(raw, safe="").encode(),
        "hex": raw.hex().encode(),
        "HEX": raw.hex().upper().encode(),
    }[form]
    out, findings = scrubber(SECRETS, patterns=False, engine=engine).scrub_bytes(b"Authorization: " + encoded + b"\n")
    assert [f.kind for f in findings] == ["db"], out
    assert b"[REDACTED:db]" in out
    for trace in traces(SECRET.encode()):
        assert trace not in out
    if form.startswith("b64"):
        # the mixed characters on both sides went too: what is left decodes to the prefix at most
        left = out.split(b"[REDACTED:db]")[0].removeprefix(b"Authorization: ")
        assert len(left) <= len(prefix) * 4 // 3


def test_secrets_shorter_than_the_minimum_are_ignored() -> None:
    sc = Scrubber({"pin": "a" * (MIN_SECRET_LEN - 1), "ok": "b" * MIN_SECRET_LEN}, patterns=False)
    out, findings = sc.scrub_bytes(b"aaa bbbb")
    assert out == b"aaa [REDACTED:ok]" and [f.kind for f in findings] == ["ok"]


@pytest.mark.parametrize("engine", ENGINES)
def test_overlapping_secrets_longest_wins(engine: str) -> None:
    sc = scrubber((("short", "Secret-Val"), ("long", "hunter2-Secret-Value!")), patterns=False, engine=engine)
    assert sc.scrub_bytes(b"x hunter2-Secret-Value! y")[0] == b"x [REDACTED:long] y"
    assert sc.scrub_bytes(b"x my-Secret-Val y")[0] == b"x my-[REDACTED:short] y"
    # partly overlapping: nothing of either may remain
    sc = scrubber((("a", "abcdEFGH1234"), ("b", "EFGH1234wxyz")), patterns=False, engine=engine)
    out, findings = sc.scrub_bytes(b"<abcdEFGH1234wxyz>")
    assert out == b"<[REDACTED:a]>" and len(findings) == 1


def test_known_secret_name_wins_over_pattern_kind() -> None:
    key = "ghp_" + "A1b2C3d4E5" * 3 + "F6g7H8"
    assert scrubber((("GITHUB_TOKEN", key),)).scrub_text(f"t={key}")[0] == "t=[REDACTED:GITHUB_TOKEN]"


# -- streaming: chunk boundaries and UTF-8 ---------------------------------------------------------

STREAM_SECRETS = (("tok", "hunter2-Secret-Value!"),)
BOUNDARY_CASES = [
    b"before hunter2-Secret-Value! after",
    b"b64 " + base64.b64encode(b"user:hunter2-Secret-Value!") + b" end",
    b"key sk-proj-" + b"Ab3dE5gH7j_K9-Lm" * 3 + b" end",
    b"tg 123456789:AAH" + b"dQw4w9WgXcQ_abcdefghij-KLMNOPqrs" + b" end",
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("data", BOUNDARY_CASES, ids=["plain", "base64", "pattern", "unanchored"])
def test_secret_split_at_every_chunk_boundary(data: bytes, engine: str) -> None:
    sc = scrubber(STREAM_SECRETS, engine=engine)
    whole, findings = sc.scrub_bytes(data)
    assert b"[REDACTED:" in whole
    for i in range(1, len(data)):
        out, found, _ = streamed(sc, data, [i])
        assert (out, found) == (whole, findings), i
    assert streamed(sc, data, list(range(1, len(data))))[0] == whole  # byte by byte


@pytest.mark.parametrize("char", ["é", "€", "😀"])
def test_multibyte_neighbours_and_split_characters(char: str) -> None:
    sc = scrubber(STREAM_SECRETS)
    text = f"{char}hunter2-Secret-Value!{char}{char} {char}sk-proj-{'Ab3dE5gH7j_K9-Lm' * 3}{char}"
    data = text.encode()
    expected = f"{char}[REDACTED:tok]{char}{char} {char}[REDACTED:openai]{char}".encode()
    assert sc.scrub_bytes(data)[0] == expected
    for i in range(1, len(data)):
        for j in (i + 1, i + 2, i + 3):
            out, _, pieces = streamed(sc, data, [i, j] if j < len(data) else [i])
            assert out == expected
            for piece in pieces:
                piece.decode("utf-8")  # never a split character


def test_incomplete_character_is_held_back() -> None:
    s = Scrubber({}, patterns=False).stream()
    euro = "€".encode()
    assert s.feed(b"abc" + euro[:2]) == b"abc"
    assert s.feed(euro[2:] + b"d") == "€d".encode()
    assert s.flush() == b""


def test_hold_back_is_bounded() -> None:
    s = scrubber(STREAM_SECRETS).stream()
    chunk = b"2024-05-01 INFO request handled in 12ms\n" * 200
    assert len(s.feed(chunk)) >= len(chunk) - 256
    assert len(s.feed(chunk)) >= len(chunk) - 64


def test_findings_carry_stream_offsets() -> None:
    s = scrubber(STREAM_SECRETS).stream()
    out = s.feed(b"x" * 1000) + s.feed(b" hunter2-Secret-Value! ") + s.flush()
    assert out.count(b"[REDACTED:tok]") == 1
    assert [(f.start, f.end) for f in s.findings] == [(1001, 1022)]


def test_scan_text_offsets_are_characters() -> None:
    text = "é€😀 AKIAZ7QW2ERTYUIOP3LK"
    (f,) = scan_text(text)
    assert text[f.start : f.end] == "AKIAZ7QW2ERTYUIOP3LK"
    assert scan_text("x hunter2-Secret-Value!", dict(STREAM_SECRETS))[0].kind == "tok"


def test_engines_agree() -> None:
    data = b"\n".join(
        [encode(t.encode(), e, p) for _, t, _ in PATTERN_CASES for e in ENCODINGS for p in PREFIXES]
        + [base64.b64encode(b"u:" + SECRET.encode()), SECRET.encode().hex().encode()]
    )
    results = {e: scrubber(SECRETS, engine=e).scrub_bytes(data) for e in ENGINES}
    first = results[ENGINES[0]]
    assert all(r == first for r in results.values())


# -- actions, allowlist, fingerprints ------------------------------------------------------------


def test_allowlist_suppresses_documented_examples() -> None:
    text = "AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE\naws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\n"
    assert len(scrubber().scan_text(text)) == 2
    allowed = scrubber(allow=tuple(EXAMPLE_KEYS))
    assert allowed.scrub_text(text) == (text, [])
    encoded = base64.b64encode(b"id AKIAIOSFODNN7EXAMPLE\n")
    assert allowed.scrub_bytes(encoded) == (encoded, [])


def test_block_raises_without_the_value() -> None:
    key = "sk-proj-" + "Ab3dE5gH7j_K9-Lm" * 3
    sc = scrubber(action=LeakAction.BLOCK)
    with pytest.raises(SecretLeakBlocked) as info:
        sc.scrub_bytes(f"token {key}".encode())
    err = info.value
    assert isinstance(err, SandmanError)
    assert "openai" in str(err) and err.finding.fingerprint in str(err)
    for text in (str(err), repr(err), repr(err.finding), str(err.finding.model_dump())):
        assert key not in text and "Ab3dE5gH7j" not in text
    # in a stream, the chunk with the secret is never returned, and the stream stays failed
    s = sc.stream()
    assert s.feed(b"harmless line\n" * 100)
    with pytest.raises(SecretLeakBlocked):
        s.feed(f"token {key} ".encode() + b"." * 200)
    with pytest.raises(SecretLeakBlocked):
        s.feed(b"more")


def test_warn_leaves_the_text_and_reports() -> None:
    data = b"token AKIAZ7QW2ERTYUIOP3LK and hunter2-Secret-Value!"
    out, findings = scrubber(STREAM_SECRETS, action=LeakAction.WARN).scrub_bytes(data)
    assert out == data
    assert [(f.kind, data[f.start : f.end]) for f in findings] == [
        ("aws_access_key", b"AKIAZ7QW2ERTYUIOP3LK"),
        ("tok", b"hunter2-Secret-Value!"),
    ]


def test_fingerprints_are_keyed_and_encoding_independent() -> None:
    value = "hunter2-Secret-Value!"
    data = f"{value} {base64.b64encode(value.encode()).decode()} {value.encode().hex()}".encode()
    prints = {f.fingerprint for f in scrubber(STREAM_SECRETS).scrub_bytes(data)[1]}
    assert len(prints) == 1
    (fp,) = prints
    assert len(fp) == 12 and fp != hashlib.sha256(value.encode()).hexdigest()[:12]
    other = Scrubber(dict(STREAM_SECRETS), fingerprint_key=b"k" * 32).scrub_bytes(data)[1][0]
    assert other.fingerprint != fp


def test_feed_after_flush_is_an_error() -> None:
    s = scrubber().stream()
    s.flush()
    with pytest.raises(ValueError):
        s.feed(b"x")


# -- properties ------------------------------------------------------------------------------------

# No letters or digits in the filler, so it cannot form a secret, an encoding or a pattern; each
# secret holds one "Z", first, so two inserted side by side cannot form a third across the seam.
FILLER = st.text(alphabet=" .,;!?()[]{}<>\n\té€😀ü", max_size=40)
PROP_SECRETS = {"alpha": "Zq7Kx9Lm2Np", "beta": "Zr8-Tt_Uu5v", "gamma": "Zs9Vw0Xy1Ba2Bc3", "delta": "ZqK7x9"}


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(st.tuples(FILLER, st.sampled_from(sorted(PROP_SECRETS))), max_size=8),
    tail=FILLER,
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
    pauses=st.lists(st.integers(min_value=0, max_value=12), max_size=12),
    engine=st.sampled_from(ENGINES),
)
def test_property_streamed_output_replaces_exactly_the_secrets(
    parts: list[tuple[str, str]], tail: str, cuts: list[int], pauses: list[int], engine: str
) -> None:
    """Whatever the chunking and wherever the stream goes idle (release), the output is the
    input with exactly the secrets replaced."""
    sc = scrubber(tuple(PROP_SECRETS.items()), engine=engine)
    data = "".join(f + PROP_SECRETS[name] for f, name in parts) + tail
    expected = "".join(f"{f}[REDACTED:{name}]" for f, name in parts) + tail
    raw = data.encode()
    out, findings, pieces = streamed(sc, raw, sorted({c for c in cuts if c < len(raw)}), pauses)
    assert out.decode() == expected
    assert [f.kind for f in findings] == [name for _, name in parts]
    assert not any(v.encode() in out for v in PROP_SECRETS.values())
    for piece in pieces:
        piece.decode("utf-8")


FRAGMENTS = st.one_of(
    st.sampled_from([t for _, t, _ in PATTERN_CASES] + ["hunter2-Secret-Value!", "Secret-Val", "é€😀"]).map(str.encode),
    st.tuples(
        st.sampled_from([t for _, t, _ in PATTERN_CASES[::3]]),
        st.sampled_from(ENCODINGS),
        st.sampled_from(PREFIXES),
    ).map(lambda a: encode(a[0].encode(), a[1], a[2])),
    st.binary(max_size=120).map(base64.b64encode),
    st.text(alphabet="abcXYZ019 :._-%=+/\\\n€", max_size=60).map(str.encode),
)


@settings(max_examples=150, deadline=None)
@given(
    fragments=st.lists(FRAGMENTS, max_size=10),
    cuts=st.lists(st.integers(min_value=0, max_value=6000), max_size=10),
    pauses=st.lists(st.integers(min_value=0, max_value=10), max_size=10),
    engine=st.sampled_from(ENGINES),
)
def test_property_chunking_never_changes_the_output(
    fragments: list[bytes], cuts: list[int], pauses: list[int], engine: str
) -> None:
    sc = scrubber((("tok", "hunter2-Secret-Value!"), ("sub", "Secret-Val")), engine=engine)
    data = b"".join(fragments)
    whole = sc.scrub_bytes(data)
    out, findings, _ = streamed(sc, data, sorted({c for c in cuts if c < len(data)}), pauses)
    assert (out, findings) == whole


# -- idle pauses (release) and the views: escapes, terminal codes, wrapped base64 ---------------

PAUSE_SECRETS = (("alpha", "Zq7Kx9Lm2Np"), ("db", SECRET), ("tok", "hunter2-Secret-Value!"))
GH_TOKEN = "ghp_" + "Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0FeDcBa"
_UNDO = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\\u001[bB]\[[0-?]*[ -/]*[@-~]|\\u([0-9a-fA-F]{4})|\\([/\"\\])")


def json_escaped(raw: bytes, mask: int) -> bytes:
    """``raw`` as in a JSON string: characters whose bit in ``mask`` is set as \\u00XX, the
    others as JSON must or may (PHP's json_encode writes \\/)."""
    out = []
    for i, c in enumerate(raw):
        ch = bytes([c])
        if mask >> (i % 64) & 1:
            out.append(b"\\u%04x" % c)
        elif ch in b'"\\/':
            out.append(b"\\" + ch)
        else:
            out.append(ch)
    return b"".join(out)


def ansi_interleaved(raw: bytes, mask: int, colour: int) -> bytes:
    """``raw`` with an SGR colour code before the characters whose bit in ``mask`` is set."""
    out = []
    for i, c in enumerate(raw):
        if mask >> (i % 64) & 1:
            out.append(b"\x1b[%d;1m" % colour if i % 3 else b"\x1b[0m")
        out.append(bytes([c]))
    return b"".join(out)


def undone(out: bytes) -> bytes:
    """The output as a reader would see it: terminal codes gone, JSON escapes decoded, lines joined."""

    def one(m: re.Match[bytes]) -> bytes:
        if m.group(1):
            return chr(int(m.group(1), 16)).encode()
        return m.group(2) or b""

    return _UNDO.sub(one, out).replace(b"\r", b"").replace(b"\n", b"")


def wrapped(blob: bytes, width: int) -> bytes:
    enc = base64.b64encode(blob)
    return b"\n".join(enc[i : i + width] for i in range(0, len(enc), width)) + b"\n"


@st.composite
def dressed(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """A known secret or a token, in one of the forms the scrubber covers; and what of it must not
    be found in the output (its plain value, its base64 cores)."""
    known = draw(st.booleans())
    if known:
        value = dict(PAUSE_SECRETS)[draw(st.sampled_from([n for n, _ in PAUSE_SECRETS]))].encode()
        secret = value
    else:
        _, token, part = draw(
            st.sampled_from([c for c in PATTERN_CASES if c[0] != "private_key"] + [("github", GH_TOKEN, "")])
        )
        value, secret = token.encode(), (part or token).encode()
    prefix = draw(st.sampled_from([b"", b" ", b": ", b"k: ", b"x" * 36 + b": ", b"y" * 94 + b" "]))
    forms = ["plain", "json", "ansi", "b64", "b64url", "b32", "hex", "url", "wrap64", "wrap76"]
    if value.startswith((b"M", b"1")):  # Discord, Telegram: base64 across a line break is out of scope
        forms = forms[:-2]
    form = draw(st.sampled_from(forms))
    mask = draw(st.sampled_from([2**64 - 1, 1, 1 << 4]) | st.integers(0, 2**64 - 1))
    if form == "plain":
        text = value
    elif form == "json":
        text = json_escaped(value, mask)
    elif form == "ansi":
        text = ansi_interleaved(value, mask, draw(st.integers(30, 37)))
    elif form.startswith("b64"):
        text = encode(value, "base64url" if form == "b64url" else "base64", prefix[-3:])
    elif form.startswith("b32"):
        text = base64.b32encode(prefix[-4:] + value)
    elif form in ("hex", "url"):
        text = encode(value, form, prefix[-2:])
    else:
        text = b"\n" + wrapped(prefix + value + b"\n", int(form[4:]))  # as base64(1) prints it
    checks = [secret]
    if value is not secret or form.startswith(("b64", "wrap")):
        checks += [core for _, core in _b64_cores(secret)]
    if known and form == "b32":  # base32: known secrets only
        checks += [core for _, core, _ in _b32_cores(secret)]
    return text, checks


FILLER_BYTES = st.text(alphabet="abcXYZ019 :._-%=+/\\\n€\x1b[mu", max_size=30).map(str.encode)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.one_of(dressed(), FILLER_BYTES.map(lambda b: (b, []))), max_size=6),
    sep=st.sampled_from([b"", b" ", b"\n", b"; "]),
    cuts=st.lists(st.integers(min_value=0, max_value=1500), max_size=10),
    pauses=st.lists(st.integers(min_value=0, max_value=10), max_size=12),
    quoting=st.booleans(),
)
def test_property_pauses_never_let_a_secret_through(
    parts: list[tuple[bytes, list[bytes]]], sep: bytes, cuts: list[int], pauses: list[int], quoting: bool
) -> None:
    """Any chunking, any idle pauses: the output is the one-shot output, and no secret or token
    in any covered form (escaped, colour-coded, encoded, wrapped) comes out in any form.
    ``quoting``: a known secret has a quote and a backslash, so \\" and \\\\ are decoded too."""
    sc = scrubber(PAUSE_SECRETS + ((("q", 'pa"ss\\w0rd'),) if quoting else ()))
    data = sep.join(text for text, _ in parts)
    whole = sc.scrub_bytes(data)
    out, findings, _ = streamed(sc, data, sorted({c for c in cuts if c < len(data)}), pauses)
    assert (out, findings) == whole
    if sep:  # fragments kept apart: each must be caught on its own
        seen = undone(out)
        for _, checks in parts:
            for trace in checks:
                assert trace not in seen, (trace, out)


def _every_form() -> list[tuple[str, bytes]]:
    value = SECRET.encode()
    tg = "123456789:AAH" + "dQw4w9WgXcQ_abcdefghij-KLMNOPqrs"
    discord = "MTk4NjIyNDgzNDcxOTI1MjQ4.Cl2FMQ.ZnCjm1XVW7vRze4b7Cq4se7kKWs"
    return [
        ("plain", b"pw " + value + b" ok"),
        ("base64", b"auth " + base64.b64encode(b"u:" + value) + b" ok"),
        ("base64url", b"auth " + base64.urlsafe_b64encode(b"u:" + value).rstrip(b"=") + b" ok"),
        ("base32", b"b32 " + base64.b32encode(b"uu:" + value) + b" ok"),
        ("hex", b"hex " + value.hex().encode() + b" ok"),
        ("url", b"url " + quote(value, safe="").encode() + b" ok"),
        ("json-all", b'{"pw": "' + json_escaped(value, 2**64 - 1) + b'"}'),
        ("json-some", b'{"pw": "' + json_escaped(value, 0x5A5A5A) + b'"}'),
        ("ansi", b"pw " + ansi_interleaved(value, 0b1010101010101, 31) + b"\x1b[0m ok"),
        ("wrapped", b"$ base64\n" + wrapped(b"x" * 40 + value + b"\n", 76) + b"$ "),
        ("github", f"token {GH_TOKEN} ok".encode()),
        ("github-json", f'{{"t": "\\u0067hp_{GH_TOKEN[4:]}"}}'.encode()),
        ("github-ansi", b"t " + ansi_interleaved(GH_TOKEN.encode(), 0b100100100100101, 32) + b"\x1b[0m ok"),
        ("github-b64", b"b " + base64.b64encode(f"t={GH_TOKEN}".encode()) + b" ok"),
        ("openai", b"k=sk-proj-" + b"Ab3dE5gH7j_K9-Lm" * 3 + b" ok"),
        ("aws", b"AKIAZ7QW2ERTYUIOP3LK"),
        ("aws-secret", f'aws_secret_access_key = "{AWS_SECRET}"'.encode()),
        ("telegram", f"bot {tg} ok".encode()),
        ("telegram-b64", b"b " + base64.b64encode(f"bot {tg}".encode()) + b" ok"),
        ("discord", f"d {discord}".encode()),
        ("discord-hex", b"h " + f" {discord} ".encode().hex().encode() + b" ok"),
        ("pem", PEM_RSA.encode() + b"\nok"),
        ("colour-then-token", b"\x1b[38;2;255;255;255m" * 3 + b"sk-proj-" + b"Ab3dE5gH7j_K9-Lm" * 3 + b"\x1b[0m"),
        ("telegram-json", b'{"bot": "' + json_escaped(tg.encode(), 2**64 - 1) + b'"}'),
        ("openai-url", b"q=%3Dsk-proj-" + b"Ab3dE5gH7j%5FK9-Lm" * 3 + b"&x=1"),
    ]


@pytest.mark.parametrize(("form", "data"), _every_form(), ids=[f for f, _ in _every_form()])
def test_pause_at_every_split_changes_nothing(form: str, data: bytes) -> None:
    """The stream goes idle (release) after any prefix, or after every single byte: the output is
    still the one-shot output, so no part of the secret went out early."""
    sc = scrubber(PAUSE_SECRETS)
    whole = sc.scrub_bytes(data)
    assert b"[REDACTED:" in whole[0], whole
    for i in range(1, len(data)):
        out, found, pieces = streamed(sc, data, [i], [0, 0])
        assert (out, found) == whole, (i, pieces)
    every = list(range(1, len(data)))
    assert streamed(sc, data, every, range(len(data)))[:2] == whole


def test_release_holds_only_what_could_begin_a_secret() -> None:
    sc = scrubber(PAUSE_SECRETS)
    s = sc.stream()
    assert s.feed(b"log line\n") == b""  # feed alone holds back (more may come)
    assert s.release() == b"log line\n" and s.held == 0
    s.feed(b"token: " + GH_TOKEN[:9].encode())
    assert s.release() == b"token: " and s.held == 9  # "ghp_" and 5 token characters
    s.feed(b"not-a-token\n")  # the token ended too short: nothing to hide
    assert s.release() == GH_TOKEN[:9].encode() + b"not-a-token\n"
    s.feed(b"pw " + SECRET[:7].encode())
    assert s.release() == b"pw " and s.held == 7
    assert s.feed(SECRET[7:].encode() + b"\n") + s.release() == b"[REDACTED:db]\n"
    assert s.flush() == b""


@pytest.mark.parametrize(
    "line",
    [
        b"Downloading 45%",
        b"[####      ] 4/10 ",
        b"Password: ",
        b"Continue? [y/N] ",
        b"building (3 of 7)...",
        b"user@host:~$ ",
        b"2024-05-01 INFO request handled in 12ms\n",
        b"all done.\n",
    ],
)
def test_release_lets_ordinary_output_out_at_once(line: bytes) -> None:
    """Output that cannot begin a secret or a token (a line end, a blank, punctuation) goes out
    whole at the first idle release, whatever secrets the scrubber knows."""
    s = scrubber(PAUSE_SECRETS).stream()
    assert s.feed(line) + s.release() == line and s.held == 0


def test_release_keeps_a_partial_word_short() -> None:
    """A line cut in the middle of a word may keep its last few characters (they could be the
    start of a secret in one of its forms), never more."""
    sc = scrubber(PAUSE_SECRETS)
    for word in ["Compiling", "tests", "running", "Waiting", "v0.1.0", "eta 0:00:03", "12345678"]:
        s = sc.stream()
        out = s.feed(b"step " + word.encode()) + s.release()
        assert s.held <= 3 and out == (b"step " + word.encode())[: len(out)], (word, s.held)


_PEM_END = b"-----END RSA PRIVATE KEY-----\n"


@pytest.mark.parametrize(
    ("start", "grow", "settle", "bound"),
    [
        (b"x ghp_", b"A1b2C3d4E5", b" end\n", 4 + 251),  # a GitHub token: at most its maximal length
        (b"x AKIA", b"Z7QW", b" end\n", 4 + 16),
        (b"x " + SECRET[:3].encode(), b"", b" end\n", len(SECRET)),  # a known secret's prefix: less than it
        (b"x -----BEGIN RSA PRIVATE KEY-----\n", b"MIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyu\n", _PEM_END, PEM_MAX_BODY + 100),
    ],
)
def test_what_release_holds_is_bounded(start: bytes, grow: bytes, settle: bytes, bound: int) -> None:
    """A tail held across many idle releases, growing a little between them, never exceeds the
    bound of what it could be the beginning of -- plus, at the end of a long run of base64
    characters, at most 128 that could still decode to a token -- and goes out once settled."""
    s = scrubber(PAUSE_SECRETS).stream()
    out = s.feed(start) + s.release()
    for _ in range(60):
        out += s.feed(grow) + s.release() + s.release()
        assert s.held <= bound + 128
    out += s.feed(settle) + s.release()
    assert s.held == 0 and out.endswith(b"\n")


def test_held_tail_goes_out_scrubbed_at_flush() -> None:
    s = scrubber(PAUSE_SECRETS).stream()
    s.feed(b"leak: " + GH_TOKEN.encode())  # a whole token, nothing after it: it could still grow
    assert s.release() == b"leak: "
    assert s.flush() == b"[REDACTED:github]"


# -- the new forms, one shot ---------------------------------------------------------------------


@pytest.mark.parametrize("width", [64, 76])
@pytest.mark.parametrize("lead", range(0, 60, 7))
def test_wrapped_base64_of_a_known_secret_is_caught_across_the_line_break(width: int, lead: int) -> None:
    sc = scrubber(PAUSE_SECRETS)
    data = b"$ base64 creds\n" + wrapped(b"v" * lead + b"pw=" + SECRET.encode() + b"\n", width) + b"$ "
    out, findings = sc.scrub_bytes(data)
    assert [f.kind for f in findings] == ["db"], out
    for trace in traces(SECRET.encode()):
        assert trace not in out.replace(b"\n", b"")


def test_wrapped_base64_joins_only_whole_base64_lines() -> None:
    # a 64-hex-digit hash line followed by a word: joined, the word's token boundary would go
    data = b"f" * 64 + b"\nsk-proj-" + b"Ab3dE5gH7j_K9-Lm" * 3 + b" end\n"
    assert scrubber().scrub_bytes(data)[0] == b"f" * 64 + b"\n[REDACTED:openai] end\n"


@pytest.mark.parametrize("mask", [2**64 - 1, 1, 0b10, 0xF0F0F0F0])
def test_json_escaped_secret_and_token_are_caught(mask: int) -> None:
    sc = scrubber(PAUSE_SECRETS)
    for value, kind in [(SECRET.encode(), "db"), (GH_TOKEN.encode(), "github"), (b"hunter2-Secret-Value!", "tok")]:
        data = b'{"log": "x ' + json_escaped(value, mask) + b' y"}'
        out, findings = sc.scrub_bytes(data)
        assert [f.kind for f in findings] == [kind], (data, out)
        assert out == b'{"log": "x [REDACTED:%s] y"}' % kind.encode()


def test_json_escape_forms() -> None:
    sc = scrubber(PAUSE_SECRETS)
    assert sc.scrub_bytes(b'"p@ss:w0rd\\/+ Secret?~"')[0] == b'"[REDACTED:db]"'  # PHP's \/
    coloured = b'"\\u001b[31mZq7Kx9\\u001b[0mLm2Np"'  # JSON-escaped colour codes, one inside
    assert sc.scrub_bytes(coloured)[0] == b'"\\u001b[31m[REDACTED:alpha]"'
    # \\ is read as JSON says (a backslash) only when a known secret has a backslash or a quote;
    # otherwise "\\u0067" may be read as "\" and "g": more is redacted, never less
    assert sc.scrub_bytes(b"\\\\u0067hp_" + GH_TOKEN[4:].encode())[0] == b"\\[REDACTED:github]"
    quoting = Scrubber({"q": 'pa"ss\\w0rd'})
    assert quoting.scrub_bytes(b'{"v": "pa\\"ss\\\\w0rd"}')[0] == b'{"v": "[REDACTED:q]"}'
    assert quoting.scrub_bytes(b"\\\\u0067hp_" + GH_TOKEN[4:].encode())[0].startswith(b"\\\\u0067hp_")
    nested = b'"{\\"SecretAccessKey\\": \\"' + AWS_SECRET.encode() + b'\\"}"'  # JSON in JSON
    assert sc.scrub_bytes(nested)[0] == b'"{\\"SecretAccessKey\\": \\"[REDACTED:aws_secret_key]\\"}"'
    emoji = "😀".encode("utf-16-be")
    pair = b"\\u%04x\\u%04x" % (int.from_bytes(emoji[:2]), int.from_bytes(emoji[2:]))
    sc2 = Scrubber({"e": "ab😀cd"}, patterns=False)
    assert sc2.scrub_bytes(b"x" + pair.join([b"ab", b"cd"]) + b"y")[0] == b"x[REDACTED:e]y"
    pem = PEM_RSA.replace("\n", "\\n").replace("/", "\\/").encode()  # a key in PHP-style JSON
    out, findings = scrubber().scrub_bytes(b'{"key": "' + pem + b'"}')
    assert [f.kind for f in findings] == ["private_key"] and out == b'{"key": "[REDACTED:private_key]"}'


@pytest.mark.parametrize("mask", [2**64 - 1, 1, 0b1000, 0b1010101])
def test_colour_codes_between_the_characters_are_seen_through(mask: int) -> None:
    sc = scrubber(PAUSE_SECRETS)
    for value, kind in [(SECRET.encode(), "db"), (GH_TOKEN.encode(), "github"), (AWS_SECRET.encode(), None)]:
        coloured = ansi_interleaved(value, mask, 33)
        if kind is None:  # a token whose anchor is coloured apart from its value
            coloured = b"\x1b[1maws_secret_access_key\x1b[0m = " + coloured
            kind = "aws_secret_key"
        out, findings = sc.scrub_bytes(b"out: " + coloured + b"\x1b[0m\n")
        assert [f.kind for f in findings] == [kind], out
        assert value not in undone(out)


def test_base32_of_a_known_secret_is_caught() -> None:
    sc = scrubber(PAUSE_SECRETS)
    for lead in range(6):
        blob = base64.b32encode(b"u" * lead + b":" + SECRET.encode())
        for data in (blob, blob.rstrip(b"=")):
            out, findings = sc.scrub_bytes(b"b32 " + data + b" end")
            assert [(f.kind, f.encoding) for f in findings] == [("db", "base32")], (lead, out)
            assert out.endswith(b"[REDACTED:db] end")


def test_out_of_scope_transforms_are_not_caught() -> None:
    """What the module doc says stays out of scope really does (so nobody counts on it)."""
    import gzip

    sc = scrubber(PAUSE_SECRETS)
    value = SECRET.encode()
    for data in (value[::-1], base64.b64encode(gzip.compress(value)), base64.b64encode(value.hex().encode())):
        assert sc.scrub_bytes(data)[1] == []


@pytest.mark.parametrize("width", [64, 76])
def test_wrapped_base64_of_a_token_is_caught_wherever_the_line_breaks(width: int) -> None:
    """Its anchor's base64 may be the part broken by the line break: the joined view finds it."""
    for lead in range(0, 80, 2):
        enc = base64.b64encode(b"t" * lead + b" " + GH_TOKEN.encode() + b"\n")
        data = b"$ x\n" + b"\n".join(enc[i : i + width] for i in range(0, len(enc), width)) + b"\n$ "
        out, findings = scrubber(PAUSE_SECRETS).scrub_bytes(data)
        assert [f.kind for f in findings] == ["github"], (lead, out)
        assert streamed(scrubber(PAUSE_SECRETS), data, [len(data) // 2], [0])[0] == out

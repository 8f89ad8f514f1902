"""The operator's terminal is not the sandbox's to control.

A sandboxed command's output is untrusted: written raw to a terminal, escape sequences in it can
set the operator's clipboard (OSC 52), retitle the window, clear the screen or move the cursor to
hide what ran, and some terminals answer queries by typing into the operator's shell. When sandman
writes sandbox output to a terminal it passes it through :class:`Neutralizer` (stdlib only: the
CLI imports it before the sandbox starts).

What passes unchanged:

* text: printable ASCII and strictly valid UTF-8 (no overlong forms, no surrogates), also when a
  character is split across chunks;
* ``\\n``, ``\\r``, ``\\t``, ``\\b``;
* SGR (colours and text attributes): ``ESC [`` then only digits, ``;`` and ``:`` then ``m``, at
  most :data:`SGR_MAX_PARAMS` parameter bytes.

Everything else is made visible and inert by printing it as backslash-hex text:

* an ESC byte that does not start an SGR becomes the four characters ``\\x1b``; what followed it
  (``[2J``, ``]52;c;aGk=``, ``P...``) is plain text and is written as such, so a clipboard write
  shows as ``\\x1b]52;c;aGk=\\x07`` and an erase as ``\\x1b[2J``;
* other C0 controls and DEL: ``\\x07``, ``\\x00``, ``\\x7f``...;
* C1 controls as single bytes (0x80-0x9f outside valid UTF-8) and any other byte that is not valid
  UTF-8: ``\\x9b``, ``\\xff``...;
* C1 controls encoded as UTF-8 (U+0080-U+009F): ``\\u009b``...

The neutralizer is a stream: it holds back at most an incomplete SGR (up to
``SGR_MAX_PARAMS + 2`` bytes) or an incomplete UTF-8 character (up to 3 bytes) until the next chunk
decides it; longer would-be SGRs are neutralized at the cap. :meth:`Neutralizer.flush` at the end of
the stream neutralizes whatever is still held. Each complete unit is written at once, so two
neutralized streams (stdout and stderr) sharing a terminal cannot combine into a live sequence.
"""

from __future__ import annotations

import os
import re

# Parameter bytes allowed in one SGR sequence before it is treated as hostile.
SGR_MAX_PARAMS = 128

_UTF8_CHAR = (
    rb"[\xc2][\xa0-\xbf]"  # U+00A0-U+07FF; U+0080-U+009F (C1) excluded
    rb"|[\xc3-\xdf][\x80-\xbf]"
    rb"|\xe0[\xa0-\xbf][\x80-\xbf]"
    rb"|[\xe1-\xec\xee\xef][\x80-\xbf]{2}"
    rb"|\xed[\x80-\x9f][\x80-\xbf]"  # no UTF-16 surrogates
    rb"|\xf0[\x90-\xbf][\x80-\xbf]{2}"
    rb"|[\xf1-\xf3][\x80-\xbf]{3}"
    rb"|\xf4[\x80-\x8f][\x80-\xbf]{2}"
)
# A run of bytes that pass unchanged: printable ASCII, \n \r \t \b, whole non-C1 UTF-8 characters.
_SAFE = re.compile(rb"(?:[\x20-\x7e\n\r\t\x08]|" + _UTF8_CHAR + rb")+")
_SGR = re.compile(rb"\x1b\[[0-9;:]{0,%d}m" % SGR_MAX_PARAMS)
# What may still become an SGR once more bytes arrive (matched against the end of the buffer).
_SGR_PREFIX = re.compile(rb"\x1b(?:\[[0-9;:]{0,%d})?\Z" % SGR_MAX_PARAMS)
# What may still become a valid UTF-8 character once more bytes arrive.
_UTF8_PREFIX = re.compile(
    rb"(?:[\xc2-\xdf]"
    rb"|\xe0[\xa0-\xbf]?"
    rb"|[\xe1-\xec\xee\xef][\x80-\xbf]?"
    rb"|\xed[\x80-\x9f]?"
    rb"|\xf0(?:[\x90-\xbf][\x80-\xbf]?)?"
    rb"|[\xf1-\xf3](?:[\x80-\xbf][\x80-\xbf]?)?"
    rb"|\xf4(?:[\x80-\x8f][\x80-\xbf]?)?)\Z"
)


class Neutralizer:
    """Streaming filter for untrusted output bound for a terminal (see the module's docstring)."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        """The part of the stream up to ``data`` that is decided, neutralized."""
        return self._process(self._pending + bytes(data), final=False)

    def flush(self) -> bytes:
        """End of stream: whatever is still held back, neutralized."""
        return self._process(self._pending, final=True)

    def _process(self, buf: bytes, final: bool) -> bytes:
        self._pending = b""
        out = bytearray()
        pos, n = 0, len(buf)
        while pos < n:
            m = _SAFE.match(buf, pos)
            if m is None and buf[pos] == 0x1B:
                m = _SGR.match(buf, pos)
            if m is not None:
                out += m.group()
                pos = m.end()
                continue
            b = buf[pos]
            if not final and (
                (b == 0x1B and _SGR_PREFIX.match(buf, pos)) or (b >= 0xC2 and _UTF8_PREFIX.match(buf, pos))
            ):
                self._pending = buf[pos:]  # undecided until the next chunk; bounded by the patterns
                break
            if b == 0xC2 and pos + 1 < n and 0x80 <= buf[pos + 1] <= 0x9F:
                out += b"\\u%04x" % buf[pos + 1]  # a C1 control encoded as UTF-8
                pos += 2
                continue
            out += b"\\x%02x" % b  # ESC, C0 controls, DEL, C1 bytes, bytes that are not UTF-8
            pos += 1
        return bytes(out)


def neutralize(data: bytes) -> bytes:
    """One complete piece of output, neutralized."""
    n = Neutralizer()
    return n.feed(data) + n.flush()


def for_fd(fd: int, raw: bool = False) -> Neutralizer | None:
    """A neutralizer for sandbox output written to ``fd``, or None to write the bytes unchanged:
    when ``raw`` is asked for, or when ``fd`` is not a terminal (a pipe, a file)."""
    if raw:
        return None
    try:
        return Neutralizer() if os.isatty(fd) else None
    except OSError:
        return None

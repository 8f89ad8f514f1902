"""The command allowlist: which programs the controller may run, and which of their subcommands.

This gates the argv the controller is asked to run, nothing more. A program that is itself an
interpreter (``sh -c ...``, ``python3 -c ...``, ``make``) can run anything the image has, and git
reads aliases and refspecs from config files this check never sees: the inner layers (container,
bubblewrap, read-only mounts), not this check, are the wall. It exists to refuse the obvious
destructive calls an agent makes by mistake, with a rule name the agent can read.

Programs are identified by the basename of ``argv[0]`` (``/usr/bin/git`` is ``git``). A rule's
``blocked`` entries are written relative to the program: ``"push --force"`` is the subcommand
``push`` with the option ``--force`` anywhere after it, in any order. Each word after the
subcommand is an option that must be present (``-f``; ``--force``, which also matches
``--force=x`` and the abbreviations git accepts, like ``--forc``) or a glob that some positional
argument must match (``"push +*"`` is a force-push refspec); combined short options are expanded
(``-xdf`` holds ``-f``) and everything after ``--`` is positional. An entry that starts with an
option has no subcommand and is matched against all arguments.

For git, the subcommand is found the way git finds it: global options before it are skipped
(``-C <path>``, ``-c <k=v>``, ``--git-dir[=]<x>``, ``--no-pager``, ...), an unknown one (``--``
included: git refuses ``git -- push``) is refused, and ``git-push`` counts as ``git push``.
``-c alias.*`` is refused because an alias can rename a blocked subcommand (as are
``-c remote.*.push``, ``remote.*.mirror`` and ``clean.requireForce``, which turn a plain push or
clean into a blocked one). For other programs
the subcommand is ``argv[1]`` when it is not an option; options before it are refused when the
rule depends on the subcommand (their arguments cannot be told from it).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field, field_validator

_PROGRAM = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class _Block:
    text: str
    sub: str | None
    longs: tuple[str, ...]  # option names without "--"
    shorts: tuple[str, ...]  # single letters
    globs: tuple[str, ...]  # each must match some positional argument


@lru_cache(maxsize=512)
def _parse_block(text: str) -> _Block:
    words = text.split()
    if not words:
        raise ValueError("an empty blocked entry: write e.g. 'push --force'")
    sub = None if words[0].startswith("-") else words[0]
    longs: list[str] = []
    shorts: list[str] = []
    globs: list[str] = []
    for word in words[1:] if sub else words:
        if word.startswith("--"):
            if len(word) == 2 or "=" in word:
                raise ValueError(f"blocked {text!r}: write options by name only ('--force', not '--force=x')")
            longs.append(word[2:])
        elif word.startswith("-") and len(word) > 1:
            shorts.extend(word[1:])
        else:
            globs.append(word)
    return _Block(text, sub, tuple(longs), tuple(shorts), tuple(globs))


def _program_name(name: str) -> str:
    if not _PROGRAM.match(name):
        raise ValueError(f"{name!r} is not a program name: use the basename, e.g. 'git' (not '/usr/bin/git')")
    return name


class ProgramRule(_Strict):
    """What one program may do; every list is checked, a refusal names the entry that fired."""

    allowed_subcommands: list[str] | None = None  # None: any subcommand not otherwise blocked
    blocked_subcommands: list[str] = Field(default_factory=list)
    blocked: list[str] = Field(default_factory=list)  # "push --force", "clean -f", "push +*"

    @field_validator("allowed_subcommands", "blocked_subcommands")
    @classmethod
    def _subcommands(cls, value: list[str] | None) -> list[str] | None:
        for sub in value or ():
            if not sub or sub.startswith("-") or any(c.isspace() for c in sub):
                raise ValueError(f"{sub!r} is not a subcommand: write one word such as 'push'")
        return value

    @field_validator("blocked")
    @classmethod
    def _blocks(cls, value: list[str]) -> list[str]:
        for text in value:
            _parse_block(text)
        return value


class CommandsPolicy(_Strict):
    """The programs the controller may run (``allow``; None means any) and per-program rules."""

    allow: list[str] | None = None
    # Unset: the default git rules, so an operator who writes only an allowlist keeps them.
    rules: dict[str, ProgramRule] = Field(default_factory=lambda: dict(DEFAULT_RULES))

    @field_validator("allow")
    @classmethod
    def _allow(cls, value: list[str] | None) -> list[str] | None:
        for name in value or ():
            _program_name(name)
        return value

    @field_validator("rules")
    @classmethod
    def _rules(cls, value: dict[str, ProgramRule]) -> dict[str, ProgramRule]:
        for name in value:
            _program_name(name)
        return value


# What an agent should not do to a repository without a human: rewrite or delete remote history,
# throw away uncommitted work, delete untracked files or unmerged branches.
GIT_RULE = ProgramRule(
    blocked_subcommands=["filter-branch"],
    blocked=[
        "push --force",
        "push -f",
        "push --force-with-lease",
        "push --mirror",
        "push --delete",
        "push -d",
        "push --prune",  # deletes remote branches that have no local counterpart
        "push +*",  # a +refspec is a force push: git push origin +main
        "push :?*",  # an empty source deletes: git push origin :main
        "reset --hard",
        "clean -f",  # also -fd, -df, -xfd, -ff
        "clean --force",
        "checkout -f",
        "checkout --force",
        "switch -f",
        "switch --force",
        "switch --discard-changes",
        "branch -D",
        "branch -d -f",
        "branch -d --force",
        "branch --delete -f",
        "branch --delete --force",
    ],
)
DEFAULT_RULES: dict[str, ProgramRule] = {"git": GIT_RULE}
# Any program, with the git rules: what a policy without a [commands] table should get.
DEFAULT_COMMANDS = CommandsPolicy(rules=DEFAULT_RULES)


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    rule: str  # the policy entry that decided, e.g. "commands.rules.git.blocked: 'push --force'"
    reason: str  # one line for a human or an agent

    def __str__(self) -> str:
        return f"{'allowed' if self.allowed else 'refused'} by {self.rule}: {self.reason}"


@dataclass(frozen=True)
class _Args:
    longs: tuple[tuple[str, str], ...]  # (name, as written)
    shorts: tuple[tuple[str, str], ...]  # (letter, as written)
    positionals: tuple[str, ...]


def _split_args(args: Sequence[str]) -> _Args:
    longs: list[tuple[str, str]] = []
    shorts: list[tuple[str, str]] = []
    positionals: list[str] = []
    options_done = False
    for arg in args:
        if options_done or arg == "-" or not arg.startswith("-"):
            positionals.append(arg)
        elif arg == "--":
            options_done = True
        elif arg.startswith("--"):
            longs.append((arg[2:].split("=", 1)[0], arg))
        else:
            shorts.extend((letter, arg) for letter in arg[1:])
    return _Args(tuple(longs), tuple(shorts), tuple(positionals))


def _block_hit(block: _Block, args: _Args) -> str | None:
    """What in ``args`` makes ``block`` match (for the message), or None."""
    evidence: list[str] = []
    for name in block.longs:
        # git's option parser accepts any unambiguous prefix: --forc is --force.
        hit = next((w for n, w in args.longs if n and name.startswith(n)), None)
        if hit is None:
            return None
        evidence.append(hit)
    for letter in block.shorts:
        hit = next((w for c, w in args.shorts if c == letter), None)
        if hit is None:
            return None
        evidence.append(hit)
    for glob in block.globs:
        hit = next((p for p in args.positionals if fnmatchcase(p, glob)), None)
        if hit is None:
            return None
        evidence.append(hit)
    return " ".join(dict.fromkeys(evidence))


# git's own options before the subcommand (git.c handle_options, 2.39 to 2.46).
_GIT_WITH_VALUE = frozenset(
    {
        "-C",
        "-c",
        "--git-dir",
        "--work-tree",
        "--namespace",
        "--super-prefix",
        "--config-env",
        "--shallow-file",
        "--attr-source",
    }
)
_GIT_FLAGS = frozenset(
    {
        "-p",
        "--paginate",
        "-P",
        "--no-pager",
        "--no-replace-objects",
        "--bare",
        "--literal-pathspecs",
        "--glob-pathspecs",
        "--noglob-pathspecs",
        "--icase-pathspecs",
        "--no-optional-locks",
        "--no-lazy-fetch",
        "--no-advice",
        "--exec-path",
        "--html-path",
        "--man-path",
        "--info-path",
    }
)
_GIT_WITH_EQUALS = frozenset(
    {
        "--git-dir",
        "--work-tree",
        "--namespace",
        "--super-prefix",
        "--config-env",
        "--exec-path",
        "--list-cmds",
        "--attr-source",
    }
)
# Settings given with -c that change what a command does: an alias can be any subcommand, a
# configured "+refspec" or mirror makes a plain push a force push, and clean stops needing -f.
_GIT_RISKY_CONFIG = ("alias.*", "remote.*.push", "remote.*.mirror", "clean.requireforce")
_GIT_AS_SUBCOMMAND = {"-v": "version", "--version": "version", "-h": "help", "--help": "help"}


@dataclass(frozen=True)
class _Parsed:
    sub: str | None
    rest: tuple[str, ...]  # arguments after the subcommand
    error: str | None = None


def _parse_git(args: Sequence[str]) -> _Parsed:
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            return _Parsed(arg, tuple(args[i + 1 :]))
        if arg in _GIT_AS_SUBCOMMAND:
            return _Parsed(_GIT_AS_SUBCOMMAND[arg], tuple(args[i + 1 :]))
        name, eq, value = arg.partition("=")
        if arg in _GIT_WITH_VALUE:
            if i + 1 >= len(args):
                return _Parsed(None, ())
            value, i = args[i + 1], i + 2
        elif eq and name in _GIT_WITH_EQUALS:
            i += 1
        elif arg in _GIT_FLAGS:
            i += 1
            continue
        else:
            return _Parsed(None, (), f"{arg!r} is not a git option git accepts before the subcommand")
        if name in ("-c", "--config-env"):
            key = value.split("=", 1)[0]
            if any(fnmatchcase(key.lower(), risky) for risky in _GIT_RISKY_CONFIG):
                return _Parsed(
                    None,
                    (),
                    f"'{name} {key}' can turn an allowed git command into a blocked one: run the command without it",
                )
    return _Parsed(None, ())


def _parse_generic(args: Sequence[str], rule: ProgramRule) -> _Parsed:
    if args and not args[0].startswith("-"):
        return _Parsed(args[0], tuple(args[1:]))
    needs_sub = (
        rule.allowed_subcommands is not None
        or bool(rule.blocked_subcommands)
        or any(_parse_block(b).sub for b in rule.blocked)
    )
    if args and needs_sub:
        return _Parsed(
            None,
            (),
            f"option {args[0]!r} comes before the subcommand, which this rule cannot parse: put the subcommand first",
        )
    return _Parsed(None, tuple(args))


def _refuse(rule: str, reason: str) -> Verdict:
    return Verdict(False, rule, reason)


def check_command(argv: Sequence[str], policy: CommandsPolicy) -> Verdict:
    """Whether ``policy`` lets the controller run ``argv``; a refusal names the entry that fired."""
    if isinstance(argv, str):
        raise TypeError("argv must be a sequence of arguments, not a string")
    if not argv or not argv[0]:
        return _refuse("commands", "the command is empty")
    program = posixpath.basename(argv[0])
    if not program:
        return _refuse("commands", f"{argv[0]!r} names a directory, not a program")
    if policy.allow is not None and program not in policy.allow:
        return _refuse("commands.allow", f"{program!r} is not in the allowlist ({', '.join(policy.allow)})")
    allowed_by = (
        Verdict(True, "commands.allow", f"{program!r} is in the allowlist")
        if policy.allow is not None
        else Verdict(True, "commands.allow", "any program may run (no allowlist is set)")
    )

    args = list(argv[1:])
    if program in policy.rules:
        rule_name, rule = program, policy.rules[program]
        parsed = _parse_git(args) if program == "git" else _parse_generic(args, rule)
    elif program.startswith("git-") and "git" in policy.rules:
        # git-push is git push (git's exec-path programs, and git.c's own "git-xxxx" handling).
        rule_name, rule = "git", policy.rules["git"]
        parsed = _Parsed(program[4:], tuple(args))
    else:
        return allowed_by

    key = f"commands.rules.{rule_name}"
    if parsed.error:
        return _refuse(key, parsed.error)
    sub = parsed.sub
    if sub is not None and sub in rule.blocked_subcommands:
        return _refuse(f"{key}.blocked_subcommands: {sub!r}", f"{rule_name} {sub} is blocked")
    if rule.allowed_subcommands is not None and sub not in rule.allowed_subcommands:
        said = f"{sub!r} is not" if sub is not None else "no subcommand given; it must be"
        return _refuse(f"{key}.allowed_subcommands", f"{said} one of {', '.join(rule.allowed_subcommands)}")
    split_rest = _split_args(parsed.rest)
    split_all: _Args | None = None
    for text in rule.blocked:
        block = _parse_block(text)
        if block.sub is None:
            # No subcommand in the entry: look at everything after the program's global options.
            split_all = split_all or _split_args(((sub,) if sub else ()) + parsed.rest)
            hit = _block_hit(block, split_all)
        elif block.sub == sub:
            hit = _block_hit(block, split_rest)
        else:
            continue
        if hit is not None:
            said = " ".join(w for w in (rule_name, sub, hit) if w)
            return _refuse(f"{key}.blocked: {text!r}", f"{said!r} matches the blocked {text!r}")
    if sub is None:
        return Verdict(True, key, f"{rule_name} with no subcommand: nothing in the rule applies")
    return Verdict(True, key, f"no entry blocks {rule_name} {sub}")


def explain(argv: Sequence[str], policy: CommandsPolicy) -> str:
    """One line for a human: ``refused: git push --force (commands.rules.git.blocked: ...)``."""
    verdict = check_command(argv, policy)
    said = "allowed" if verdict.allowed else "refused"
    # repr() for arguments with newlines or other control characters keeps the text on one line.
    shown = " ".join(shlex.quote(a) if a.isprintable() else repr(a) for a in argv)
    return f"{said}: {shown} ({verdict.rule}: {verdict.reason})"

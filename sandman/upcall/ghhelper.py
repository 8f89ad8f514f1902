"""The ``gh`` upcall helper: gh-restricted (sandman.upcall.ghrestricted) behind the relay.

The sandbox's ``gh`` shim sends its argv here; gh-restricted decides (reads from a fixed list,
draft PRs on allowed repos, edits and comments only on PRs this session created) and runs the
real ``gh`` with an argv rebuilt from the decision. The GitHub token is a host secret named in the
helper's config; it exists only in that gh process's environment. In ``draft-prs`` mode a PR's
head must be a branch this session pushed through git-push (its ``git.pushed`` audit events).
"""

from __future__ import annotations

import asyncio
from typing import ClassVar, Literal

from pydantic import Field

from sandman.upcall.ghrestricted import GhConfig, GhError, GhRefused, evaluate, execute
from sandman.upcall.helpers import (
    GitPushConfig,
    GitPushHelper,
    Helper,
    HelperContext,
    HelperError,
    HelperResult,
    _Config,
)


class GhHelperConfig(_Config):
    mode: Literal["read-only", "draft-prs"] = "read-only"
    allowed_repos: list[str] = Field(default_factory=list)
    host: str = "github.com"
    token_secret: str = Field(default="GITHUB_TOKEN", description="settings secret holding the token")
    ca_file: str | None = Field(default=None, description="extra CA bundle for a private GitHub Enterprise")
    gh_path: str = "gh"


class GhHelper(Helper):
    name: ClassVar[str] = "gh"
    description: ClassVar[str] = "GitHub CLI, restricted: reads, and draft pull requests on allowed repositories"
    Config: ClassVar[type[_Config]] = GhHelperConfig

    async def run(self, args: list[str], stdin: str | None, ctx: HelperContext) -> HelperResult:
        cfg = self.config
        assert isinstance(cfg, GhHelperConfig)
        creates = cfg.mode == "draft-prs" and args[:1] == ["pr"] and args[1:2] in (["create"], ["new"])
        pushed, prefix = await asyncio.to_thread(self._pushed, ctx) if creates else (None, None)
        gh_config = GhConfig(mode=cfg.mode, allowed_repos=cfg.allowed_repos, host=cfg.host, head_prefix=prefix)
        decision = evaluate(args, gh_config, ctx.created_prs, pushed)
        if not decision.allowed:
            raise HelperError(f"{decision.message} (rule: {decision.rule.value})")
        token = self.settings.secrets.get(cfg.token_secret)
        if token is None:
            raise HelperError(f"gh: the host has no secret {cfg.token_secret!r} (settings [secrets])")
        env_extra = {"SSL_CERT_FILE": cfg.ca_file} if cfg.ca_file else {}
        try:
            result = await asyncio.to_thread(
                execute, decision, gh_config, token.get_secret_value(), cfg.gh_path, env_extra
            )
        except (GhRefused, GhError) as exc:
            raise HelperError(str(exc)) from None
        if result.created_pr is not None and decision.action is not None:
            pr = (decision.action.repo, result.created_pr)
            ctx.created_prs.add(pr)
            if ctx.record is not None:
                ctx.record("gh.pr_created", repo=pr[0], number=pr[1])
        return HelperResult(result.exit_code, result.stdout, result.stderr, result.truncated)

    def _pushed(self, ctx: HelperContext) -> tuple[set[str] | None, str]:
        """The branches this session pushed (None when the record cannot be read), and git-push's
        branch prefix: the rule for a PR's head when there is no record."""
        pushed = GitPushHelper.pushed_branches(self.settings, ctx.session_id)
        policy = ctx.policy or GitPushHelper.session_policy(self.settings, ctx.session_id)
        raw = policy.upcalls.helpers.get(GitPushHelper.name) if policy is not None else None
        prefix = GitPushConfig.model_fields["branch_prefix"].default
        if isinstance(raw, dict) and isinstance(raw.get("branch_prefix"), str):
            prefix = raw["branch_prefix"]
        return pushed, prefix

"""A tiny library with a bug for the demo agent to fix."""


def add(a: int, b: int) -> int:
    return a - b  # BUG: the agent fixes this

"""`invoke shell` and `invoke exec -- CMD...`: a shell or one command in the container, with the run
environment (the venv first on PATH, the compile caches, the inventory's env) in paths.code.

Both go through commands.pct_exec and the host session like every other command. `exec` runs
without a terminal: output streamed (shown visibly, as every task shows the container's text),
stdout and stderr apart, and the command's exit code is the task's. `shell` runs on a pty with this
terminal's keystrokes; what the shell writes reaches the terminal as written, because the operator
asked for a terminal in the container (as `logs --raw` is asked for).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .. import commands, payload
from ..errors import UsageError
from ..target import Target

# In paths.code ($1) when it exists (not yet deployed: the home directory); bash when the container
# has it, else sh; interactive either way.
SHELL_SCRIPT = ('cd "$1" 2>/dev/null || cd; '
                'if command -v bash >/dev/null 2>&1; then exec bash -i; fi; exec sh -i')



def command_after_dashes(argv: Sequence[str]) -> list[str]:
    """What follows the first `--` of the command line, each argument as given (Invoke's own
    remainder is joined with spaces, which would lose `"a b"`)."""
    if "--" not in argv:
        raise UsageError("exec: give the command after --, e.g. `invoke exec --ct 200 -- nvidia-smi`")
    command = list(argv[list(argv).index("--") + 1:])
    if not command or not command[0]:
        raise UsageError("exec: the command after -- is empty, e.g. `invoke exec --ct 200 -- nvidia-smi`")
    return command


@dataclass
class Exited:
    """What is left to show once the command's output has streamed: nothing, and its exit code."""

    exit_with: int

    def describe(self) -> str:
        return ""


def execute(t: Target, argv: Sequence[str], timeout: float | None = None) -> Exited:
    """Run argv in the container with the run environment, streamed, within `timeout` s
    (payload.TIMEOUTS' by default); its exit code is the task's."""
    ct = t.container
    timeout = payload.timeout_of("exec", timeout)
    with payload.deadline(ct, "the command", timeout):
        result = t.session.exec(ct, list(argv), env=ct.run_env(), cwd=ct.paths.code, check=False, stream=True,
                                timeout=timeout)
    return Exited(result.exited)


def shell(t: Target) -> Exited:
    """An interactive shell in the container on a pty, with the run environment; its exit code is the
    task's."""
    ct = t.container
    if not t.dry_run and not sys.stdin.isatty():
        raise UsageError("shell needs a terminal on stdin; for one command use `invoke exec -- CMD...`")
    env = ct.run_env({"TERM": os.environ.get("TERM") or "xterm", "PS1": f"[{ct.label}] \\w \\$ "})
    result = t.session.exec(ct, commands.sh_script(SHELL_SCRIPT, ct.paths.code), env=env, check=False,
                            pty=True, stdin=True, out_stream=sys.stdout)
    return Exited(result.exited)

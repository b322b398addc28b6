"""Command lines for the host's shell. Pure functions: no I/O, unit-tested with tables of exact lines.

Everything that reaches a shell goes through `quote`. `pct exec` runs no shell inside the container,
loads no profile and forces PATH, so the environment and working directory are applied explicitly
with `env -i [-C DIR] -- K=V ... argv`: the argv is parsed exactly once, by the host's login shell.
"""

from __future__ import annotations

import re
import shlex
from typing import Iterable, Mapping, Sequence

from .errors import UnsafeValue

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MASK = "***"


def _check(value: str) -> str:
    if not isinstance(value, str):
        raise UnsafeValue(f"expected text, got {type(value).__name__}: {value!r}")
    if "\x00" in value:
        raise UnsafeValue(f"value contains a NUL byte, which no command line can carry: {value[:40]!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafeValue(f"value is not valid UTF-8: {value[:40]!r}") from None
    return value


def quote(value) -> str:
    """The one quoting function: a single shell word that the host's shell reads back as `value`."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    return shlex.quote(_check(value))


def shell_line(argv: Sequence) -> str:
    """Join an argv into one line for a POSIX shell, each element quoted."""
    if not argv:
        raise UnsafeValue("empty command")
    return " ".join(quote(a) for a in argv)


def env_argv(env: Mapping[str, str] | None = None, cwd: str | None = None) -> list[str]:
    """`env -i [-C cwd] -- K=V ...`: a clean, explicit environment without a shell."""
    argv = ["env", "-i"]
    if cwd is not None:
        argv += ["-C", _check(cwd)]
    argv.append("--")
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise UnsafeValue(f"malformed environment variable name: {name!r}")
        argv.append(f"{name}={_check(str(value))}")
    return argv


def pct_exec(ctid: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
             cwd: str | None = None, pct: str = "pct") -> str:
    """The host command line that runs `argv` in container `ctid` with exactly `env` and `cwd`."""
    if isinstance(ctid, bool) or not isinstance(ctid, int):
        raise UnsafeValue(f"container id must be an integer, got {ctid!r}")
    if not argv:
        raise UnsafeValue("empty command")
    argv = [_check(a) for a in argv]
    if "=" in argv[0]:
        # env(1) would read it as another assignment instead of the program to run.
        raise UnsafeValue(f"program name must not contain '=': {argv[0]!r}")
    return shell_line([pct, "exec", str(ctid), "--", *env_argv(env, cwd), *argv])


def pct_transfer(verb: str, ctid: int, src: str, dst: str, pct: str = "pct", perms: str | None = None) -> str:
    """`pct push|pull <ctid> <src> <dst>` (one file per call, as Proxmox does)."""
    if verb not in ("push", "pull"):
        raise UnsafeValue(f"unknown pct transfer verb {verb!r}")
    argv = [pct, verb, str(int(ctid)), src, dst]
    if perms is not None:
        argv += ["--perms", perms]
    return shell_line(argv)


def sh_script(script: str, *args: str) -> list[str]:
    """argv for a constant shell script inside the container; user values travel only as "$1".. ."""
    return ["sh", "-c", script, "sh", *[_check(a) for a in args]]


def and_then(*lines: str) -> str:
    """Several host command lines in one round trip; stops at the first failure."""
    return " && ".join(f"{{ {line}; }}" if "&&" in line or "||" in line else line for line in lines)


def mask(text: str, secrets: Iterable[str]) -> str:
    """Hide secret values (raw and quoted forms) in anything shown to a person."""
    for value in sorted({s for s in secrets if s}, key=len, reverse=True):
        # Inside a quoted word such as 'HF_TOKEN=a'"'"'b' a value's quotes are spelled '"'"'.
        for form in sorted({shlex.quote(value), value, value.replace("'", "'\"'\"'")}, key=len, reverse=True):
            text = text.replace(form, MASK)
    return text

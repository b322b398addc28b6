"""Command lines for the host's shell. Pure functions: no I/O, unit-tested with tables of exact lines.

Everything that reaches a shell goes through `quote`. `pct exec` runs no shell inside the container,
loads no profile and forces PATH, so the environment and working directory are applied explicitly
with `env -i [-C DIR] -- K=V ... argv`: the argv is parsed exactly once, by the host's login shell.
pct itself runs as `env LC_ALL=C.UTF-8 [sudo -n] pct` (pct_argv), and what it runs in the container
runs under SESSION_SCRIPT, which ends it with the SSH session.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence

from .errors import UnsafeValue

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# pct decodes its arguments with the SSH session's locale (pve-common's decode('locale')): under C,
# the locale of a session that got no LANG, every non-ASCII byte becomes U+FFFD. It runs under this.
PCT_LOCALE = "C.UTF-8"
BECOME = ("sudo",)  # the inventory's `become:` values
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MASK = "***"


def _check(value: str) -> str:
    if not isinstance(value, str):
        raise UnsafeValue(f"expected text, got {type(value).__name__}: {value!r}")
    if "\x00" in value:
        raise UnsafeValue(f"value contains a NUL byte, which no command line can carry: {value[:40]!r}")
    if not is_utf8(value):
        raise UnsafeValue(f"value is not valid UTF-8: {value[:40]!r}")
    return value


def is_utf8(value: str) -> bool:
    """False for text holding a lone surrogate (a non-UTF-8 byte of argv, as Python decodes it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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


# Every command that `pct exec` runs is tied to its SSH session. Without a tty, a dropped session
# signals nothing in the container: lxc-attach may die, the command goes on (a quiet one for ever,
# a talkative one until a write fails half-way through). So the command runs in a process group of
# its own, and a watcher blocks on the session's stdin (the tool never writes to it or closes it):
# end of file there means the session is gone, and the group gets SIGTERM, SIGKILL 5 s later. A
# hang-up, SIGTERM or Ctrl-C (SIGINT through a pty) reaching this shell ends the group with SIGTERM
# (a command started in the background by sh ignores SIGINT, and could not trap it); after Ctrl-C
# the exit status is 130, as the tasks expect of an interrupted command.
# Once the command ends, whatever it left in its group goes too; a detached run (`setsid -f`) is in
# a session of its own and stays. $@: the command. (dash's kill takes no `--` and stops at its first
# failing pid: one `kill -SIG -PGID` each.)
SESSION_SCRIPT = "; ".join([
    # The traps first: a signal that comes before the command has started ends it as it starts.
    """trap 'i=130; t=1; kill -TERM "-$c" 2>/dev/null' INT""",
    """trap 'h=1; t=1; kill -TERM "-$c" 2>/dev/null' HUP TERM""",
    'exec 3<&0 </dev/null',
    'setsid "$@" 3<&- & c=$!',
    """setsid sh -c 'while read -r _; do :; done; kill -TERM "-$1"; sleep 5; kill -KILL "-$1"' """
    'dflash-watch "$c" <&3 3<&- >/dev/null 2>&1 & w=$!',
    'exec 3<&-',
    '[ -z "$i$h" ] || kill -TERM "$c"',
    # A trapped signal cuts `wait` short (status 128+signal) and leaves the job to wait for again: $t
    # says a trap ran. A trap that ran just before `wait` started cut nothing short: that wait
    # consumed the job, and the next one answers 127 (unknown pid), so the first status stands.
    't=; wait "$c"; s=$?',
    'while [ "$s" -gt 128 ] && [ -n "$t" ]; do t=; wait "$c"; r=$?; [ "$r" = 127 ] && break; s=$r; done',
    # The watcher by pid too: it may not have made its own group yet when a quick command ends.
    # Then reaped: SIGKILL is delivered, not awaited, and a watcher killed but not yet gone was
    # still in the container's process list after its task had returned. It is one process (the
    # shell's own `read`, no `cat`), so once it is reaped nothing of the session is left.
    'kill -KILL "$w" 2>/dev/null; kill -KILL "-$w" 2>/dev/null; wait "$w" 2>/dev/null',
    'kill -KILL "-$c" 2>/dev/null',
    'exit "${i:-$s}"',
])


def session_tied(argv: Sequence[str]) -> list[str]:
    """argv under SESSION_SCRIPT: it ends when the SSH session that started it ends."""
    return ["sh", "-c", SESSION_SCRIPT, "dflash-session", *argv]


def pct_argv(pct: str = "pct", become: str | None = None) -> list[str]:
    """How every pct is started on the host: `env LC_ALL=C.UTF-8 [sudo -n] pct`.

    With `become: sudo`, sudo's default env_keep passes LC_ALL on, the sudoers rule can name pct
    alone, and `-n` makes a sudo that wants a password fail at once ("sudo: a password is
    required") instead of waiting for one that never comes."""
    if become is not None and become not in BECOME:
        raise UnsafeValue(f"become: {become!r} is not one of {', '.join(BECOME)}")
    return ["env", f"LC_ALL={PCT_LOCALE}", *(["sudo", "-n"] if become == "sudo" else []), _check(pct)]


def _pct(pct: str | Sequence[str]) -> list[str]:
    """A pct path (started as pct_argv does) or the argv that pct_argv built (Host.pct_command)."""
    return pct_argv(pct) if isinstance(pct, str) else list(pct)


def pct_line(pct: str | Sequence[str], *args) -> str:
    """`pct <args>` on the host, such as `pct status 200`."""
    return shell_line([*_pct(pct), *args])


def pct_exec(ctid: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
             cwd: str | None = None, pct: str | Sequence[str] = "pct", tied: bool = True) -> str:
    """The host command line that runs `argv` in container `ctid` with exactly `env` and `cwd`.

    `tied=False` (`invoke shell`, on a pty only): without SESSION_SCRIPT, so the command keeps the
    terminal and its stdin; the pty's hang-up ends it when the session goes."""
    if isinstance(ctid, bool) or not isinstance(ctid, int):
        raise UnsafeValue(f"container id must be an integer, got {ctid!r}")
    if not argv:
        raise UnsafeValue("empty command")
    argv = [_check(a) for a in argv]
    if "=" in argv[0]:
        # env(1) would read it as another assignment instead of the program to run.
        raise UnsafeValue(f"program name must not contain '=': {argv[0]!r}")
    command = [*env_argv(env, cwd), *argv]
    return pct_line(pct, "exec", str(ctid), "--", *(session_tied(command) if tied else command))


def pct_transfer(verb: str, ctid: int, src: str, dst: str, pct: str | Sequence[str] = "pct",
                 perms: str | None = None) -> str:
    """`pct push|pull <ctid> <src> <dst>` (one file per call, as Proxmox does)."""
    if verb not in ("push", "pull"):
        raise UnsafeValue(f"unknown pct transfer verb {verb!r}")
    argv = [verb, str(int(ctid)), src, dst]
    if perms is not None:
        argv += ["--perms", perms]
    return pct_line(pct, *argv)


def sh_script(script: str, *args: str) -> list[str]:
    """argv for a constant shell script inside the container; user values travel only as "$1".. ."""
    return ["sh", "-c", script, "sh", *[_check(a) for a in args]]


def mask(text: str, secrets: Iterable[str]) -> str:
    """Hide secret values (raw and quoted forms) in anything shown to a person."""
    for value in sorted({s for s in secrets if s}, key=len, reverse=True):
        # Inside a quoted word such as 'HF_TOKEN=a'"'"'b' a value's quotes are spelled '"'"'.
        for form in sorted({shlex.quote(value), value, value.replace("'", "'\"'\"'")}, key=len, reverse=True):
            text = text.replace(form, MASK)
    return text

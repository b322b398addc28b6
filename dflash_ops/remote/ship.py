"""Shipping a helper into a container, and reading its answer: the one way every helper is called.

A helper travels as the text of `prelude.py` followed by its own (its import of the prelude removed:
the names are defined just above it), compressed as one argument of a constant `python -S -c` run by
the container's own interpreter; the values travel as one JSON argument:

    pct exec CT -- python3 -S -c LOADER <prelude + helper, packed> <verb> '<json>'

Its reply is read by `answer()`, the one reader: the transport has already cut it at `cap` bytes
(nothing larger is held in memory, the command is ended), and every call has a deadline. The last
line is the answer, {"ok": value} or {"error": kind, "message": ...} (prelude.serve); anything else is
one line naming the container and what was wrong with it, never a traceback.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import zlib
from pathlib import Path

from .. import commands, runs, terminal
from ..errors import RemoteCommandFailed, RunStateError, TimedOut, UntrustedData, UsageError
from ..inventory import Container
from ..transport import AnswerTooLarge, stderr_tail
from .facts import FACTS

HERE = Path(__file__).parent
HELPERS = ("runs", "facts", "fetch", "history", "release")
ANSWER_CAP = 8 << 20        # bytes of a reply read at most (metrics: METRICS_CAP)
METRICS_CAP = 64 << 20      # the metrics verb sends up to 16 MiB of each of two files, JSON-escaped
PART = ".dflash-part"       # a pushed file lands as <dest>.dflash-part until its size and sha256 are checked
DEFAULT_TIMEOUT_S = 120.0   # a helper call's deadline unless the caller names one
STREAM_GRACE_S = 30.0       # a streamed verb's answer after its deadline: ending its process group, 5 s
PRELUDE_IMPORT = re.compile(r"^from dflash_ops\.remote\.prelude import (?:\([^)]*\)|[^\n]*)\n", re.M)
ALL_FACTS = FACTS  # every fact the facts helper answers

# The script travels compressed as one argument, so a host line stays one line (dry-run prints one
# per line) and short; the loader is a constant and the values are separate arguments.
# The loader keeps the packed text as `_PACKED`: the runs helper's launch verb hands it to the run's
# wrapper for its `ended` hook, so the launch line carries the helper once, not twice.
LOADER = "import base64,sys,zlib;_PACKED=sys.argv.pop(1);exec(zlib.decompress(base64.b64decode(_PACKED)))"


@functools.cache
def source(helper: str) -> str:
    """The text a helper is shipped as: the prelude, then the helper without its prelude import."""
    if helper not in HELPERS:
        raise ValueError(f"no helper {helper!r}")
    prelude = (HERE / "prelude.py").read_text(encoding="utf-8")
    own = (HERE / f"{helper}.py").read_text(encoding="utf-8")
    return prelude + "\n\n" + PRELUDE_IMPORT.sub("", own, count=1)


@functools.cache
def packed(helper: str) -> str:
    return base64.b64encode(zlib.compress(source(helper).encode("utf-8"), 9)).decode("ascii")


def argv(container: Container, helper: str, verb: str, payload: dict) -> list[str]:
    """Container argv: one verb of a helper on the container's system python (-S: stdlib only, a
    third of the interpreter's start)."""
    return [container.python, "-S", "-c", LOADER, packed(helper), verb, json.dumps(payload, sort_keys=True)]


def line(container: Container, helper: str, verb: str, payload: dict, env: dict | None = None) -> str:
    """Host line of one verb; `env` defaults to a bare PATH and locale (the run environment is the
    caller's choice: facts checks the venv with it)."""
    env = env if env is not None else {"PATH": commands.SYSTEM_PATH, "LANG": "C.UTF-8"}
    return commands.pct_exec(container.ctid, argv(container, helper, verb, payload), env=env,
                             pct=container.host.pct_command)


class Refusal(RemoteCommandFailed):
    """A helper's refusal: {"error": kind, "message"}; `kind` and `extra` for the caller to map."""

    def __init__(self, where: str, kind: str, message: str, extra: dict):
        super().__init__(f"{where}: {message}")
        self.kind, self.message, self.extra = kind, message, extra


class BadAnswer(UntrustedData, ValueError):
    """A reply that is not an answer of the protocol (missing, cut, not JSON, the wrong shape), or a
    field of one that is not what it should be. A ValueError too: the pure parsers raise it."""


def _last_line(text: str) -> str | None:
    end = len(text.rstrip())
    if end == 0:
        return None
    start = text.rfind("\n", 0, end) + 1
    return text[start:end].rstrip("\r")


def answer(text, where: str, cap: int = ANSWER_CAP):
    """A helper's stdout -> its "ok" value. Refusal for {"error"}, BadAnswer (one line, naming
    `where`) for anything else. Lines are split on `\\n` only: JSON escapes every other control
    character."""
    if not isinstance(text, str):
        raise BadAnswer(f"{where}: no answer from the container")
    if len(text) > cap:
        raise BadAnswer(f"{where}: the answer is larger than {cap} bytes: refused")
    last = _last_line(text)
    try:
        value = json.loads(last) if last is not None else None
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict) or not ("ok" in value or isinstance(value.get("error"), str)):
        shown = terminal.visible(last or "(nothing)")[:120]
        raise BadAnswer(f"{where}: no complete answer from the container (its last line: {shown!r})")
    if "ok" in value:
        return value["ok"]
    message = value.get("message")
    message = terminal.visible(message if isinstance(message, str) else "(no message)")[:300]
    kind = terminal.visible(value["error"])[:40]
    extra = {k: v for k, v in value.items() if k not in ("error", "message")}
    if kind == "no-run" and "runs" in extra:  # the prelude's resolve_run: the one unknown-run line
        raise runs.no_such_run(extra.get("name"), where.partition(": ")[0], extra["runs"])
    raise Refusal(where, kind, message, extra)


def field(value, name: str, kind: type, where: str):
    """`value[name]` when it has the type the protocol says, else BadAnswer naming the field."""
    got = value.get(name) if isinstance(value, dict) else None
    if not isinstance(got, kind) or (kind is int and isinstance(got, bool)):
        raise BadAnswer(f"{where}: the answer's field {name!r} is not a {kind.__name__}")
    return got


# The refusals every caller reads the same way; a caller maps its own kinds first.
COMMON = {"no-run": RunStateError, "usage": UsageError, "unsafe": UntrustedData, "timeout": TimedOut}


def raise_common(refusal: Refusal, hint: str = "") -> None:
    """Re-raise a refusal as the error class of its kind (RemoteCommandFailed for the others)."""
    cls = COMMON.get(refusal.kind)
    if cls is not None:
        raise cls(str(refusal) + hint) from None
    raise refusal


def run(t, host_line: str, where: str, *, timeout: float, cap: int = ANSWER_CAP, **kwargs):
    """Run a helper's host line within `timeout` s and `cap` bytes (the transport cuts it there and
    ends the command): the Result; BadAnswer naming `where` for a reply past the cap."""
    try:
        return t.session.run_in(t.container, host_line, timeout=timeout, limit=cap, **kwargs)
    except AnswerTooLarge:
        raise BadAnswer(f"{where}: the answer passed {cap} bytes: refused unread, the command was "
                        "ended") from None


def call(t, helper: str, verb: str, payload: dict, *, timeout: float = DEFAULT_TIMEOUT_S,
         cap: int = ANSWER_CAP, env: dict | None = None, what: str | None = None):
    """One verb of a helper in `t.container`, in one round trip, within `timeout` seconds and `cap`
    bytes: its "ok" value (None in a dry run). Refusal / BadAnswer / the transport's errors."""
    ct = t.container
    where = f"{ct.label}: {what or verb}"
    result = run(t, line(ct, helper, verb, dict(payload, deadline_s=timeout), env), where,
                 timeout=timeout + 5, cap=cap, check=False)
    if t.dry_run:
        return None
    if not result.ok and not result.stdout.strip():
        raise RemoteCommandFailed(f"{where}: exit {result.exited}: "
                                  f"{terminal.visible(result.stderr.strip()[-300:]) or '(no stderr)'}",
                                  exited=result.exited)
    return answer(result.stdout, where, cap)


def streamed(t, helper: str, verb: str, payload: dict, on_line, *, timeout: float,
             env: dict | None = None, what: str | None = None):
    """One verb whose {"line"} items are shown as they come (deploy's pip and tiny-target build):
    each to `on_line(text)`, then its answer through `answer()`. The verb ends what it runs at
    `timeout` (its deadline) and answers; the transport gives up STREAM_GRACE_S later. Its "ok"
    value (None in a dry run)."""
    ct = t.container
    where = f"{ct.label}: {what or verb}"
    stream = Stream(lambda item: isinstance(item.get("line"), str) and on_line(item["line"]))
    result = t.session.run_in(ct, line(ct, helper, verb, dict(payload, deadline_s=timeout), env),
                              timeout=timeout + STREAM_GRACE_S, out_stream=stream, check=False)
    stream.close()
    if t.dry_run:
        return None
    if stream.answer is None and not result.ok:
        raise RemoteCommandFailed(f"{where}: exit {result.exited}: "
                                  f"{terminal.visible(result.stderr.strip()[-300:]) or '(no stderr)'}",
                                  exited=result.exited)
    return answer(json.dumps(stream.answer) if stream.answer is not None else "", where)


class Stream:
    """A helper's streamed reply (over a pty), as a file-like out_stream for the transport: each
    complete line is one JSON item; the answer ({"ok"} or {"error"}) is kept in `answer`, every
    other item handed to `on_item`. Linear in the data whatever its lines' length: a line longer
    than ITEM_CAP is dropped as it arrives (no item of the protocol is that long); a line that is not
    a JSON object (the pty's echo of ^C, noise) is skipped."""

    ITEM_CAP = 1 << 16

    def __init__(self, on_item):
        self.on_item, self.answer = on_item, None
        self._parts: list[str] = []
        self._size = 0

    def write(self, data: str) -> int:
        pieces = data.replace("\r", "").split("\n")
        for i, piece in enumerate(pieces):
            if self._size <= self.ITEM_CAP:
                self._parts.append(piece)
                self._size += len(piece)
            if i < len(pieces) - 1:
                text = "".join(self._parts) if self._size <= self.ITEM_CAP else ""
                self._parts, self._size = [], 0
                self._item(text)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._parts and self._size <= self.ITEM_CAP:
            self._item("".join(self._parts))
        self._parts, self._size = [], 0

    def _item(self, raw: str) -> None:
        try:
            item = json.loads(raw) if raw.strip() else None
        except (ValueError, RecursionError):
            item = None
        if not isinstance(item, dict):
            return
        if "ok" in item or "error" in item:
            self.answer = item
        else:
            self.on_item(item)


def facts_payload(container: Container, want, torch_check: str = "always") -> dict:
    p = container.paths
    return {"code": p.code, "venv": p.venv, "model": p.model, "runs": p.runs, "caches": p.caches.all(),
            "want": sorted(want), "torch_check": torch_check}


def facts_line(container: Container, want=ALL_FACTS, torch_check: str = "always") -> str:
    """torch_check "always" imports torch in the venv (doctor); "recorded" reuses the venv's last passing
    check while its requirements and the container's GPU set are unchanged (deploy)."""
    return line(container, "facts", "facts", facts_payload(container, tuple(want), torch_check),
                env=container.run_env())


def facts(t, want=ALL_FACTS, torch_check: str = "always", timeout: float = 600.0) -> dict | None:
    """The facts helper's answer (doctor, deploy): one round trip; the torch check may take minutes."""
    ct = t.container
    value = call(t, "facts", "facts", facts_payload(ct, tuple(want), torch_check), timeout=timeout,
                 env=ct.run_env())
    if value is not None and not isinstance(value, dict):
        raise BadAnswer(f"{ct.label}: facts: the answer is not an object")
    return value


# --- a file pushed into a container ------------------------------------------------------------

def push_line(container: Container, host_path: str, ct_path: str, size: int, sha256: str) -> str:
    """`pct push` to `<ct_path>.dflash-part`, then release.py's push-check in the container: renamed
    to `ct_path` when its size and sha256 are these (nothing else in the container changes when the
    push failed or was short). Read with push_failure, then answer()."""
    part = f"{ct_path}{PART}"
    check = line(container, "release", "push-check",
                 {"part": part, "dest": ct_path, "size": int(size), "sha256": sha256})
    push = commands.pct_transfer("push", container.ctid, host_path, part, pct=container.host.pct_command)
    return f"{push} && {check}"


def push_failure(container: Container, result, what: str, size: int) -> RemoteCommandFailed | None:
    """The error for a push that was not whole (the check's `short-push` refusal), with pct's own words
    when it said any (a real `pct push` exits 0 when it fails); None for any other reply."""
    try:
        answer(result.stdout, f"{container.label}: push")
    except Refusal as refusal:
        if refusal.kind != "short-push":
            return None
        said = stderr_tail(result.stderr)
        if said:
            return RemoteCommandFailed(f"{container.label}: pct push of {what} failed: {said}; nothing "
                                       "changed in the container", exited=result.exited, stderr_tail=said)
        got = refusal.extra.get("got")
        got = got if isinstance(got, int) and not isinstance(got, bool) else 0
        return RemoteCommandFailed(f"{container.label}: pct push of {what} wrote {got} of {size} bytes and "
                                   "said nothing (a full disk in the container?); nothing changed in the "
                                   "container", exited=result.exited)
    except BadAnswer:
        return None
    return None

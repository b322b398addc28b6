"""`invoke watch --run NAME`: poll a run until it ends and emit an event on every change.

Each poll is the status task's one round trip (`status.gather`); `changes(before, now)` (pure)
turns two consecutive RunStatus into events:

    watching   the first poll found the run alive        started    it appeared and is alive
    waiting    the first poll found no such run          (--wait: it may be about to start)
    stalled    alive but silent past --stall-after       hung       ... and past --hang-after
    recovered  a stalled run logs again                  signature  a known failure in the log's tail
    evaluation a new held-out evaluation or `invoke eval`
    restarted  the run's wrapper relaunched it after a transient crash (`train --max-restarts`)
    crashed / finished / stopped / gone                  the run ended (the watch ends with it)
    unreachable / reachable                              a poll failed / the next one worked again

An event is a dict (see `Event.to_dict`): JSON for `--notify-cmd`, the body of `--webhook`, and one
line on stdout. The watch itself never waits for a receiver (notify.Outbox).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from .. import runs
from .. import status as status_mod
from ..errors import ConnectError, ContainerError, RemoteCommandFailed, UsageError
from ..runs import validate_run_name
from .monitoring import Thresholds

ENDED = ("crashed", "finished", "stopped")
CRASH_PAGE = "docs/runbooks/alerting.md"  # a crash without a known signature: its first moves


@dataclass
class Event:
    event: str
    text: str
    host: str = ""
    ct: str = ""
    run: str | None = None
    state: str | None = None
    step: int | None = None
    runbook: str | None = None
    time: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def to_dict(self) -> dict:
        return asdict(self)


def _progress(st) -> str:
    bits = [f"step {st.step}" if st.step is not None else "",
            f"loss {st.loss:.4g}" if isinstance(st.loss, (int, float)) else "",
            f"acceptance {st.acceptance_length:.3g}" if isinstance(st.acceptance_length, (int, float))
            else ""]
    return ", ".join(b for b in bits if b)


def _ending(st) -> tuple[str, str | None]:
    if st.state == "crashed":
        pages = [f["runbook"] for f in st.findings if f["key"] != runs.STALLED.key]
        page = pages[0] if pages else CRASH_PAGE
        return f"crashed: {st.detail}; read {page}", page
    return f"{st.state} ({st.detail})", None


def changes(before, now, hang_after: float) -> list[tuple[str, str, str | None]]:
    """(kind, text, runbook) for what changed from `before` (None: first poll) to `now`. Pure."""
    out = []
    progress = _progress(now)
    suffix = f" at {progress}" if progress else ""
    was = before.state if before is not None else None
    if now.state != was:
        if now.state == "running":
            kind = {None: "watching", "stalled": "recovered"}.get(was, "started")
            out.append((kind, f"running{suffix}" if kind != "recovered" else f"logging again{suffix}", None))
        elif now.state == "stalled":
            out.append(("stalled", f"stalled{suffix}: {now.detail}", runs.STALLED.runbook))
        elif now.state in ENDED:
            text, page = _ending(now)
            out.append((now.state, text + (f"; last {progress}" if progress else ""), page))
        elif now.state in ("missing", "none") and was in ("running", "stalled"):
            out.append(("gone", "the run directory is gone", None))
        elif now.state in ("missing", "none") and was is None:
            out.append(("waiting", "does not exist yet; waiting for it to start", None))
    hung_now = now.state == "stalled" and (now.idle_s or 0) >= hang_after
    hung_before = before is not None and before.state == "stalled" and (before.idle_s or 0) >= hang_after
    if hung_now and not hung_before:
        out.append(("hung", f"no new log line or metric for {now.idle_s} s (hang threshold {hang_after:g} s)",
                    runs.STALLED.runbook))
    seen = {f["key"] for f in (before.findings if before is not None else [])}
    for f in now.findings:
        if f["key"] not in seen and f["key"] != runs.STALLED.key:
            out.append(("signature", f"{f['title']} in the log: {f['line'][:300]}", f["runbook"]))
    if before is not None:
        seg, was_seg = now.segment or {}, before.segment or {}
        if seg.get("kind") == "restart" and (seg.get("n") or 0) > (was_seg.get("n") or 0):
            out.append(("restarted", f"restarted automatically (restart {seg.get('restart') or '?'}, "
                        f"segment {seg['n']}) after the training process ended: "
                        f"{runs.describe_exit(seg.get('after'))}; resuming from step "
                        f"{seg.get('from_step') or 0}",
                        None))
        if now.eval_step is not None and now.eval_step != before.eval_step:
            loss = (f"held-out loss {now.eval_loss:.4g}" if isinstance(now.eval_loss, (int, float))
                    else "held-out eval")
            out.append(("evaluation", f"{loss} at step {now.eval_step}", None))
        if now.last_eval and now.last_eval != before.last_eval:
            out.append(("evaluation", f"invoke eval: {status_mod.describe_eval(now.last_eval)}", None))
    return out


POLL_ERRORS = (ConnectError, ContainerError, RemoteCommandFailed)


def watch_run(t, run: str, every: float, stall_after: float, hang_after: float, emit,
              sleep=time.sleep, max_polls: int | None = None, wait: bool = False) -> str:
    """Poll until the run ends; `emit(Event)` for each change. Returns the final state. A run that is
    not there at the first poll is NoSuchRun (the one unknown-run line), unless `wait`: then the
    `waiting` event, and the watch waits for it to start.

    A failed poll (host unreachable, container stopped, a command failed) is an `unreachable`
    event, once, and the watch goes on; `reachable` when a poll works again. Ctrl-C
    (KeyboardInterrupt) propagates to the caller, which closes the sinks."""
    ct = t.container
    label = {"host": ct.host.name, "ct": str(ct.ctid)}
    before, failing, polls = None, False, 0
    while max_polls is None or polls < max_polls:
        polls += 1
        try:
            now = status_mod.gather(t, run, stall_after, missing_ok=wait or before is not None)
        except POLL_ERRORS as exc:
            if not failing:
                emit(Event("unreachable", f"cannot read the run's facts: {exc}", run=run, **label))
                failing = True
            sleep(every)
            continue
        except ValueError as exc:  # a truncated answer: try again next poll
            emit(Event("unreachable", f"incomplete status answer: {exc}", run=run, **label))
            sleep(every)
            continue
        if failing:
            emit(Event("reachable", "the run's facts can be read again", run=run, state=now.state, **label))
            failing = False
        for kind, text, page in changes(before, now, hang_after):
            emit(Event(kind, f"run {run} on {ct.label} {text}", run=run, state=now.state, step=now.step,
                       runbook=page, **label))
        if now.state in ENDED or (now.state in ("missing", "none") and before is not None
                                  and before.state in ("running", "stalled")):
            return now.state
        before = now
        sleep(every)
    return before.state if before is not None else "unknown"


def check_watchable(run: str | None, every: float, stall_after: float, hang_after: float) -> None:
    """Bad flags fail at once, not at the first poll."""
    if not run:
        raise UsageError("--run NAME: the run to watch")
    validate_run_name(run)
    if every <= 0:
        raise UsageError(f"--every {every:g}: must be > 0 seconds")
    Thresholds(stall_after=stall_after, hang_after=hang_after)

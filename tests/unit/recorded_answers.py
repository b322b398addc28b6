"""Recorded container outputs of the line-based fact scripts (before remote/runs.py), turned into
the JSON answers remote/runs.py's verbs give for the same run directories (in the one answer format,
with the state decided by the prelude's run_state as the container decides it), so that the recorded
runs keep testing the parsers: `status_answer(text)` for `status`, `metrics_answer(text)` for `metrics`.
"""

import json

from dflash_ops.remote.prelude import number, run_state

FILES = ("pid", "pgid", "started", "ended", "exit_code", "stopped", "code_version")


def status_answer(text: str, stall_after: float = 600) -> str:
    """`key value` fact lines -> the status verb's JSON line (a cut answer stays cut)."""
    answer = {"files": {}, "metrics": [], "log": [], "gpus": None}
    complete = False
    for raw in text.split("\n"):
        key, _, value = raw.rstrip("\r").partition(" ")
        if key == "metric":
            answer["metrics"].append(value)
        elif key == "log":
            answer["log"].append(value)
        elif key == "gpu":
            answer["gpus"] = (answer["gpus"] or []) + [value]
        elif key == "evaljson":
            answer["eval"] = value
        elif key == "datajson":
            answer["data"] = value
        elif key in FILES:
            answer["files"][key] = value.strip()
        elif key == "checkpoint":
            latest, _, written = value.partition(" ")
            answer["checkpoint"] = {"latest": latest,
                                    "mtime": int(written) if written.strip().isdigit() else None}
        elif key in ("now", "mtime_log", "mtime_metrics", "free", "free_runs", "free_shm"):
            answer[key] = int(value) if value.strip().lstrip("-").isdigit() else value
        elif key in ("exists", "alive"):
            answer[key] = value.strip() == "1"
        elif key == "name":
            answer["name"] = value.strip() or None
        elif key == "end":
            complete = True
    if answer.get("exists"):
        files = answer["files"]
        times = [answer.get("mtime_log"), answer.get("mtime_metrics"), number(files.get("started")),
                 number(files.get("ended"))]
        times = [t for t in times if isinstance(t, int) and t]
        now = answer.get("now")
        answer["idle_s"] = max(0, now - max(times)) if times and isinstance(now, int) else None
        answer["state"], answer["detail"] = run_state(files, answer.get("alive"), answer["idle_s"],
                                                      stall_after)
    line = json.dumps({"ok": answer})
    if not complete:  # the connection was lost mid-answer
        line = line[: len(line) // 2]
    return line + ("\r\n" if "\r\n" in text else "\n")


def metrics_answer(text: str, run: str = "") -> str:
    """`== metrics` / `== evals` sections -> the metrics verb's JSON line."""
    answer = {"run": run, "metrics": [], "evals": []}
    section = None
    for line in text.split("\n"):
        if line.startswith("== "):
            section = line[3:].strip()
        elif line.strip() and section in ("metrics", "evals"):
            answer[section].append(line)
    return json.dumps({"ok": answer}) + "\n"

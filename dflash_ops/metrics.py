"""`invoke metrics`: a run's metrics.jsonl (and evals.jsonl) in one round trip, as a table and a plot.

metrics.jsonl (written by train_dflash.py) holds one JSON object per line, by `kind`:
  train       step, loss, acceptance_length, slot_accuracy [slot 1..bs-1], tokens_per_s, lr, memory_gib
  eval        step, loss, acceptance_length, slot_accuracy   (teacher-forced, held-out batches)
  checkpoint  step, path
evals.jsonl (written by eval_dflash.py) holds the dflash_generate evaluations of checkpoints.
A resumed run appends to metrics.jsonl from its checkpoint's step on: the table and the plot take each
step's values from the latest segment that logged it (`latest_values`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import runs, terminal
from .errors import UsageError
from .remote import ship
from .status import fmt

METRICS_TIMEOUT_S = 120.0


@dataclass
class RunMetrics:
    run: str
    train: list = field(default_factory=list)
    eval: list = field(default_factory=list)
    checkpoints: list = field(default_factory=list)
    dflash_evals: list = field(default_factory=list)
    skipped: int = 0  # lines that were not JSON objects (one being written as we read it)
    left_out: int = 0  # bytes at the start of metrics.jsonl not read (the container sends the newest 16 MiB)


TEXT_KEYS = ("kind", "path", "checkpoint", "target", "device", "dtype")


def _clean(key: str, value, depth=0):
    """A record's value as the table and the plot use it: finite numbers, flat lists of them, booleans;
    text only under TEXT_KEYS. Anything else becomes None (shown as '-', left out of the plot)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if abs(value) < 1 << 63 else None
    if isinstance(value, float):
        return value if math.isfinite(value) and abs(value) < 1e300 else None
    if isinstance(value, str) and key in TEXT_KEYS:
        return value[:500]
    if isinstance(value, list) and depth == 0:
        return [_clean(key, v, 1) for v in value[:256]]
    return None


def _record(line) -> dict | None:
    if not isinstance(line, str):
        return None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    record = {str(k)[:100]: _clean(str(k), v) for k, v in list(record.items())[:64]}
    if not isinstance(record.get("kind", ""), str) or isinstance(record.get("step"), bool):
        return None
    return record if isinstance(record.get("step", 0), (int, type(None))) else None


def parse_metrics(text: str, run: str = "", where: str = "metrics") -> RunMetrics:
    """remote/runs.py metrics's answer -> RunMetrics. Pure; a torn or foreign line is counted, not fatal.

    Every value is checked: numbers must be finite, lists flat; anything else becomes None (shown '-').
    """
    answer = ship.answer(text, where, ship.METRICS_CAP)
    if not isinstance(answer, dict):
        raise ship.BadAnswer(f"{where}: the answer is not an object")
    latest = answer.get("run") if isinstance(answer.get("run"), str) else ""
    out = RunMetrics(run or latest[:64])
    left_out = answer.get("metrics_left_out")
    out.left_out = left_out if isinstance(left_out, int) and not isinstance(left_out, bool) else 0
    logged = []
    for section in ("metrics", "evals"):
        given = answer.get(section)
        for line in given if isinstance(given, list) else []:
            record = _record(line)
            if record is None:
                out.skipped += 1
            elif section == "evals":
                out.dflash_evals.append(record)
            else:
                logged.append(record)
        dropped = answer.get(section + "_dropped")
        out.skipped += dropped if isinstance(dropped, int) and 0 <= dropped < 1 << 40 else 0
    for record in latest_values(logged):
        bucket = {"train": out.train, "eval": out.eval, "checkpoint": out.checkpoints}.get(
            record.get("kind", "train"))
        if bucket is None:
            out.skipped += 1
        else:
            bucket.append(record)
    return out


def latest_values(records: list[dict]) -> list[dict]:
    """metrics.jsonl's records in file order -> each step's values from the latest segment that logged
    it. Pure, linear.

    A run resumed from the checkpoint of step 500 after it had reached 700 logs steps 501.. again: a
    train record whose step is not past the previous train record's starts a new segment there (a
    rewind), and every earlier record (train, eval, checkpoint) of that step or later is dropped, the
    abandoned steps 501-700 of the old segment. A record is kept when its step is below every later
    rewind's; records without a step are kept."""
    rewinds, last = [], None
    for i, record in enumerate(records):
        step = record.get("step")
        if record.get("kind", "train") == "train" and isinstance(step, int):
            if last is not None and step <= last:
                rewinds.append((i, step))
            last = step
    if not rewinds:
        return records
    kept, below = [], None  # below: the lowest step of a rewind after the record
    for i in range(len(records) - 1, -1, -1):
        while rewinds and rewinds[-1][0] > i:
            step = rewinds.pop()[1]
            below = step if below is None else min(below, step)
        step = records[i].get("step")
        if below is None or not isinstance(step, int) or step < below:
            kept.append(records[i])
    return kept[::-1]


def fetch(t, run: str | None = None) -> RunMetrics | None:
    """Read run `run` (default: the latest) from the container in one round trip; None in a dry run."""
    ct = t.container
    name = runs.validate_run_name(run) if run is not None else None
    payload = {"runs": ct.paths.runs, "name": name, "deadline_s": METRICS_TIMEOUT_S}
    result = ship.run(t, ship.line(ct, "runs", "metrics", payload), f"{ct.label}: metrics",
                      timeout=METRICS_TIMEOUT_S + 5, cap=ship.METRICS_CAP)
    if t.dry_run:
        return None
    return parse_metrics(result.stdout, name or "", f"{ct.label}: metrics")


# --- the table ------------------------------------------------------------------------------------

def _slots(record: dict, count: int = 4) -> str:
    accuracy = record.get("slot_accuracy")
    return " ".join(fmt(a, ".2f") for a in accuracy[:count]) if isinstance(accuracy,
                                                                           list) and accuracy else "-"


def table(metrics: RunMetrics, n: int = 20):
    """A rich Table of the last `n` logged steps, held-out evaluations merged in by step."""
    from rich import box
    from rich.table import Table

    evals = {r.get("step"): r for r in metrics.eval}
    rows = metrics.train[-n:] if n > 0 else metrics.train
    # a light box without vertical rules: the table fits 80 columns
    out = Table(title=f"run {terminal.markup(metrics.run)}: last {len(rows)} of {len(metrics.train)} "
                      "logged steps",
                title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    # tf accept: teacher-forced acceptance on the dataset's answers; `invoke eval` measures the real one
    for name in ("step", "loss", "held-out", "tf accept", "slot acc 1-4", "tokens/s", "lr", "GiB"):
        out.add_column(name, justify="left" if name == "slot acc 1-4" else "right", no_wrap=True)
    for record in rows:
        held = evals.get(record.get("step"))
        cells = (str(record.get("step", "-")), fmt(record.get("loss"), ".4f"),
                 fmt(held and held.get("loss"), ".4f"), fmt(record.get("acceptance_length"), ".2f"),
                 _slots(record), fmt(record.get("tokens_per_s"), ",.0f"), fmt(record.get("lr"), ".1e"),
                 fmt(record.get("memory_gib"), ".2f"))
        out.add_row(*map(terminal.markup, cells))  # values from metrics.jsonl: shown, never markup
    return out


def eval_summary(metrics: RunMetrics) -> str | None:
    """One line about the last dflash_generate evaluation, if there is one."""
    if not metrics.dflash_evals:
        return None
    last = metrics.dflash_evals[-1]
    return (f"last dflash eval (step {fmt(last.get('step'), 'd')}): acceptance "
            f"{fmt(last.get('acceptance_length'), '.2f')}, "
            f"{fmt(last.get('tokens_per_target_forward'), '.2f')} tokens/target forward, speedup "
            f"{fmt(last.get('speedup'), '.2f')}x, lossless {'yes' if last.get('lossless') is True else 'NO'}")


@dataclass
class Shown:
    """`invoke metrics`: the table, the last dflash evaluation's line, and where the plot went."""

    metrics: RunMetrics
    n: int = 20
    plotted: str | None = None
    pipe_width = None  # on a pipe: $COLUMNS or 80 columns, as rich chooses

    def describe(self) -> list:
        """The table (rich), then text lines (printed as they are: never wrapped at the width)."""
        summary = eval_summary(self.metrics)
        return [table(self.metrics, self.n), *([summary] if summary else []),
                *([f"plot: {self.plotted}"] if self.plotted else [])]

    def facts(self) -> dict:
        """--json: the records the table shows (the last -n train steps; 0: all), every held-out
        evaluation, checkpoint and dflash evaluation, and where the plot went."""
        m = self.metrics
        return {"run": m.run, "steps": len(m.train), "train": m.train[-self.n:] if self.n > 0 else m.train,
                "eval": m.eval, "checkpoints": m.checkpoints, "dflash_evals": m.dflash_evals,
                "skipped_lines": m.skipped, "bytes_left_out": m.left_out, "plot": self.plotted}

    def row(self) -> str:
        return f"run {self.metrics.run}: {len(self.metrics.train)} logged steps"


def show(t, run: str | None = None, n: int = 20, plot_to: str | None = None) -> Shown | None:
    """Read the run's metrics (one round trip); with `plot_to`, write the plot there too (the path is
    checked first: a bad one is one line before any round trip)."""
    if plot_to:
        check_plot_path(plot_to)
    m = fetch(t, run)
    if m is None:
        return None
    return Shown(m, int(n), plot(m, plot_to) if plot_to else None)


# --- the plot -------------------------------------------------------------------------------------

def check_plot_path(path: str) -> None:
    """--plot names a .png file in an existing, writable local directory (not a directory itself)."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"--plot {path!r} is a directory: give a file name such as {target / 'run.png'}")
    if target.suffix.lower() != ".png":
        raise UsageError(f"--plot {path!r}: give a file name ending in .png")
    folder = target.parent
    if not folder.is_dir():
        raise UsageError(f"--plot {path!r}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"--plot {path!r}: the directory {folder} is not writable")


def _smooth(values: list[float], points: int) -> list[float]:
    """Exponential moving average whose window grows with the run (raw values when short)."""
    if points < 40:
        return values
    alpha, out, level = min(1.0, 10.0 / points), [], None
    for v in values:
        level = v if level is None else level + alpha * (v - level)
        out.append(level)
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _series(records: list[dict], key: str):
    pairs = [(r["step"], r[key]) for r in records if _number(r.get(key)) and r.get("step") is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


COLOUR_TRAIN, COLOUR_HELD, COLOUR_EVAL = "#1f77b4", "#d62728", "#2ca02c"


def _curve(ax, records, key, colour, label) -> None:
    """A series against step, smoothed (the raw values faint behind it)."""
    steps, values = _series(records, key)
    if not steps:
        return
    smooth = _smooth(values, len(values))
    if smooth is not values:
        ax.plot(steps, values, color=colour, alpha=0.25, linewidth=0.8)
    ax.plot(steps, smooth, color=colour, linewidth=2, label=label)


def _points(ax, records, key, colour, label, marker="o") -> None:
    steps, values = _series(records, key)
    if steps:
        ax.plot(steps, values, color=colour, marker=marker, linestyle="--", linewidth=1.2,
                markersize=6, label=label)


def _plot_loss(ax, train, held) -> None:
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    _curve(ax, train, "loss", COLOUR_TRAIN, "train")
    _points(ax, held, "loss", COLOUR_HELD, "held-out")
    ax.set_yscale("log")
    ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))  # labels at 1, 2, 5, 10, 20, 50
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    ax.set_title("Loss (decay-weighted cross-entropy)", loc="left", fontweight="bold")


def _plot_tau(ax, train, held, evals) -> None:
    _curve(ax, train, "acceptance_length", COLOUR_TRAIN, "train (teacher-forced)")
    _points(ax, held, "acceptance_length", COLOUR_HELD, "held-out (teacher-forced)")
    if evals:
        steps, values = _series(evals, "acceptance_length")
        ax.scatter(steps, values, marker="*", s=260, color=COLOUR_EVAL, zorder=5,
                   edgecolor="black", linewidth=0.6, label="dflash_generate (greedy, lossless)")
        for s, v in zip(steps, values, strict=True):
            ax.annotate(f"{v:.2f}", (s, v), textcoords="offset points", xytext=(8, -12),
                        color=COLOUR_EVAL, fontweight="bold")
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_title("Acceptance length τ: teacher-forced (lines), dflash eval (stars)", loc="left",
                 fontweight="bold")


def _plot_slots(ax, train) -> None:
    from matplotlib import cm

    for r in train:  # the per-slot panel plots numbers only
        if not isinstance(r.get("slot_accuracy"), list) or not all(map(_number, r["slot_accuracy"])):
            r["slot_accuracy"] = None
    slots = max((len(r.get("slot_accuracy") or []) for r in train), default=0)
    colours = cm.viridis([i / max(slots - 1, 1) for i in range(slots)])
    for slot in range(slots):
        rows = [r for r in train if len(r.get("slot_accuracy") or []) > slot and r.get("step") is not None]
        steps = [r["step"] for r in rows]
        values = [r["slot_accuracy"][slot] for r in rows]
        label = f"slot {slot + 1}" if slot in (0, slots - 1) or slots <= 8 else None
        ax.plot(steps, _smooth(values, len(values)), color=colours[slot], linewidth=1.6, label=label)
    ax.set_ylim(0, 1)
    ax.set_title("Per-slot accuracy (slot k predicts token anchor+k)", loc="left", fontweight="bold")


def _plot_speed(ax, train) -> None:
    _curve(ax, train, "tokens_per_s", "#9467bd", "tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput (target tokens/s) and learning rate", loc="left", fontweight="bold")
    steps, lrs = _series(train, "lr")
    if steps:
        ax_lr = ax.twinx()
        ax_lr.plot(steps, lrs, color="grey", linestyle="--", linewidth=1, label="lr")
        ax_lr.set_ylabel("learning rate", color="grey")
        ax_lr.tick_params(axis="y", colors="grey")
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        ax_lr.set_ylim(bottom=0)
        handles = [h for a in (ax, ax_lr) for h in a.get_legend_handles_labels()[0]]
        ax.legend(handles=handles, loc="lower left", fontsize=9, framealpha=0.8)


def plot(metrics: RunMetrics, path: str) -> str:
    """Loss, acceptance length, per-slot accuracy and throughput against step, in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not metrics.train and not metrics.eval:
        from .errors import RunStateError
        raise RunStateError(f"run {metrics.run} has no metrics yet: nothing to plot")
    train, held = metrics.train, metrics.eval
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), dpi=110, constrained_layout=True)
    (ax_loss, ax_tau), (ax_slot, ax_speed) = axes
    evals = [r for r in metrics.dflash_evals if r.get("step") is not None]
    _plot_loss(ax_loss, train, held)
    _plot_tau(ax_tau, train, held, evals)
    _plot_slots(ax_slot, train)
    _plot_speed(ax_speed, train)

    saved = [r["step"] for r in metrics.checkpoints if isinstance(r.get("step"), int)]
    for ax in axes.flat:
        for step in saved:
            ax.axvline(step, color="grey", alpha=0.25, linewidth=1)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.margins(x=0.04)
        if ax.get_legend_handles_labels()[0] and ax is not ax_speed:
            ax.legend(loc="best", fontsize=9, framealpha=0.8)

    last = train[-1] if train else held[-1]
    headline = (f"run {metrics.run}: step {fmt(last.get('step'), 'd')}, loss {fmt(last.get('loss'), '.3f')}, "
                f"teacher-forced τ {fmt(last.get('acceptance_length'), '.2f')}")
    if evals:
        headline += (f"; dflash eval τ {fmt(evals[-1].get('acceptance_length'), '.2f')} at step "
                     f"{fmt(evals[-1].get('step'), 'd')}")
    fig.suptitle(headline + ("   (grey lines: checkpoints)" if saved else ""), fontsize=13)
    try:
        fig.savefig(path)
    except OSError as exc:  # the directory went away or filled up since the check
        raise UsageError(f"--plot {path!r}: cannot write it: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return path

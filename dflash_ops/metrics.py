"""`invoke metrics`: a run's metrics.jsonl (and evals.jsonl) in one round trip, as a table and a plot.

metrics.jsonl (written by train_dflash.py) holds one JSON object per line, by `kind`:
  train       step, loss, acceptance_length, slot_accuracy [slot 1..bs-1], tokens_per_s, lr, memory_gib
  eval        step, loss, acceptance_length, slot_accuracy   (teacher-forced, held-out batches),
              decode_acceptance (greedy decoding walked over the same answers: what `invoke eval` measures)
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
from .errors import RunStateError, UntrustedData, UsageError
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
    """`invoke metrics`: a table per run, the last dflash evaluation's line, where the plot and the
    TensorBoard files went."""

    runs: list  # of RunMetrics, in the order --run names them
    n: int = 20
    plotted: str | None = None
    exported: list = field(default_factory=list)  # the TensorBoard run directories written
    pipe_width = None  # on a pipe: $COLUMNS or 80 columns, as rich chooses

    def describe(self) -> list:
        """The tables (rich), then text lines (printed as they are: never wrapped at the width)."""
        out = []
        for m in self.runs:
            summary = eval_summary(m)
            out += [table(m, self.n), *([summary] if summary else [])]
        return [*out, *([f"plot: {self.plotted}"] if self.plotted else []),
                *[f"tensorboard: {d}" for d in self.exported]]

    def facts(self) -> dict:
        """--json: per run the records the table shows (the last -n train steps; 0: all), every
        held-out evaluation, checkpoint and dflash evaluation; where the plot and event files went."""
        def one(m: RunMetrics) -> dict:
            shown = m.train[-self.n:] if self.n > 0 else m.train
            return {"run": m.run, "steps": len(m.train), "train": shown,
                    "eval": m.eval, "checkpoints": m.checkpoints, "dflash_evals": m.dflash_evals,
                    "skipped_lines": m.skipped, "bytes_left_out": m.left_out}
        return {"runs": [one(m) for m in self.runs], "plot": self.plotted, "tensorboard": self.exported}

    def row(self) -> str:
        return "; ".join(f"run {m.run}: {len(m.train)} logged steps" for m in self.runs)


MAX_RUNS = 8  # runs in one overlay


def run_names(run: str | None) -> list:
    """--run a,b -> the names, checked (at most MAX_RUNS, no repeats); None: the latest run."""
    if run is None:
        return [None]
    names = [name.strip() for name in str(run).split(",")]
    if len(names) > MAX_RUNS or len(set(names)) != len(names):
        raise UsageError(f"--run {str(run)[:80]!r}: at most {MAX_RUNS} different runs, comma-separated")
    return [runs.validate_run_name(name) for name in names]


def show(t, run: str | None = None, n: int = 20, plot_to: str | None = None,
         tensorboard_to: str | None = None) -> Shown | None:
    """Read each run's metrics (`--run a,b`: one round trip per run); with `plot_to`, write the plot
    there (several runs: overlaid), with `tensorboard_to`, TensorBoard event files. The paths are
    checked first: a bad one is one line before any round trip."""
    if plot_to:
        check_plot_path(plot_to)
    if tensorboard_to:
        check_tensorboard_dir(tensorboard_to)
    got = [fetch(t, name) for name in run_names(run)]
    if t.dry_run:
        return None
    return Shown(got, int(n), plot(got, plot_to) if plot_to else None,
                 export_tensorboard(got, tensorboard_to) if tensorboard_to else [])


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
    _points(ax, held, "decode_acceptance", COLOUR_HELD, "held-out (decode walk)", marker="D")
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


def plot(metrics: RunMetrics | list, path: str) -> str:
    """One run: loss, acceptance length, per-slot accuracy and throughput against step, in one PNG;
    several (a list): `overlay_figure`."""
    several = list(metrics) if isinstance(metrics, list) else [metrics]
    empty = [m.run for m in several if not m.train and not m.eval]
    if empty:
        raise RunStateError(f"run {', '.join(empty)} has no metrics yet: nothing to plot")
    fig = figure(several[0]) if len(several) == 1 else overlay_figure(several)
    return _save(fig, path)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def figure(metrics: RunMetrics):
    """One run's four panels (plot)."""
    plt = _pyplot()
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
    return fig


def overlay_figure(several: list):
    """Several runs in one figure, one colour per run, a legend naming them: loss, acceptance length
    (teacher-forced lines, dflash evaluations as stars), held-out loss and throughput against step."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), dpi=110, constrained_layout=True)
    (ax_loss, ax_tau), (ax_held, ax_speed) = axes
    for i, m in enumerate(several):
        colour = f"C{i % 10}"
        _curve(ax_loss, m.train, "loss", colour, m.run)
        _curve(ax_tau, m.train, "acceptance_length", colour, m.run)
        steps, values = _series([r for r in m.dflash_evals if r.get("step") is not None], "acceptance_length")
        if steps:
            ax_tau.scatter(steps, values, marker="*", s=200, color=colour, edgecolor="black", linewidth=0.6,
                           zorder=5)
        _points(ax_held, m.eval, "loss", colour, m.run)
        _curve(ax_speed, m.train, "tokens_per_s", colour, m.run)
    ax_loss.set_yscale("log")
    titles = ((ax_loss, "Loss (train)"), (ax_tau, "Acceptance length τ: teacher-forced, dflash eval ★"),
              (ax_held, "Held-out loss"), (ax_speed, "Throughput (target tokens/s)"))
    for ax, title in titles:
        ax.set_title(title, loc="left", fontweight="bold")
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=9, framealpha=0.8)
    fig.suptitle(f"{len(several)} runs: {', '.join(m.run for m in several)}", fontsize=13)
    return fig


def _save(fig, path: str) -> str:
    plt = _pyplot()
    try:
        fig.savefig(path)
    except OSError as exc:  # the directory went away or filled up since the check
        raise UsageError(f"--plot {path!r}: cannot write it: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return path


# --- TensorBoard ----------------------------------------------------------------------------------
# tensorboardX writes the event files (the TensorBoard format, without TensorFlow or the tensorboard
# server): DIR/<run>/events.out.tfevents.*.dflash-ops, one per run, replaced by the next export.

TB_SUFFIX = ".dflash-ops"
TB_SCALARS = (("train", "train", ("loss", "acceptance_length", "tokens_per_s", "lr", "memory_gib")),
              ("eval", "heldout", ("loss", "acceptance_length", "decode_acceptance")),
              ("dflash_evals", "dflash_eval", ("acceptance_length", "tokens_per_target_forward", "speedup")))


def check_tensorboard_dir(path: str) -> None:
    """--tensorboard names a local directory, existing or to be made in an existing writable one."""
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise UsageError(f"--tensorboard {path!r} is not a directory: give a directory for the event files")
    parent = target if target.is_dir() else target.parent
    if not parent.is_dir():
        raise UsageError(f"--tensorboard {path!r}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--tensorboard {path!r}: the directory {parent} is not writable")


def tensorboard_scalars(m: RunMetrics) -> list[tuple[str, int, float, float | None]]:
    """A run's records as (tag, step, value, wall time or None), e.g. ("train/loss", 10, 2.5, ...);
    per-slot accuracy as train/slot_accuracy/1.. (pure)."""
    out = []
    for section, prefix, keys in TB_SCALARS:
        for r in getattr(m, section):
            step, wall = r.get("step"), r.get("time")
            if not isinstance(step, int) or isinstance(step, bool):
                continue
            wall = wall if _number(wall) else None
            out += [(f"{prefix}/{key}", step, float(r[key]), wall) for key in keys if _number(r.get(key))]
            if section == "train" and isinstance(r.get("slot_accuracy"), list):
                out += [(f"train/slot_accuracy/{k}", step, float(v), wall)
                        for k, v in enumerate(r["slot_accuracy"], 1) if _number(v)]
    return out


def export_tensorboard(several: list, path: str) -> list[str]:
    """Write each run's scalars to DIR/<run>/ (its earlier export there replaced); the dirs written."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise UsageError("--tensorboard needs the tensorboardX package: pip install tensorboardX "
                         "(scripts/bootstrap installs it)") from None
    written = []
    for m in several:
        try:
            name = runs.validate_run_name(m.run)  # the latest run's name comes from the container
        except UsageError:
            raise UntrustedData(f"metrics: the run's name {terminal.visible(m.run)[:80]!r} is not a run "
                                "name: not used as a directory") from None
        folder = Path(path).expanduser() / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.glob(f"events.out.tfevents.*{TB_SUFFIX}"):
                old.unlink()
            writer = SummaryWriter(logdir=str(folder), filename_suffix=TB_SUFFIX)
            try:
                for tag, step, value, wall in tensorboard_scalars(m):
                    writer.add_scalar(tag, value, step, walltime=wall)
            finally:
                writer.close()
        except OSError as exc:
            raise UsageError(f"--tensorboard {path!r}: cannot write {folder}: {exc.strerror or exc}") \
                from None
        written.append(str(folder))
    return written

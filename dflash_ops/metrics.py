"""`invoke metrics`: a run's metrics.jsonl (and evals.jsonl) in one round trip, as a table and a plot.

metrics.jsonl (written by train_dflash.py) holds one JSON object per line, by `kind`:
  train       step, loss, acceptance_length, slot_accuracy [slot 1..bs-1], tokens_per_s, lr, memory_gib
  eval        step, loss, acceptance_length, slot_accuracy   (teacher-forced, held-out batches)
  checkpoint  step, path
evals.jsonl (written by eval_dflash.py) holds the dflash_generate evaluations of checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from . import commands, jobs

# One round trip: both files, each after a marker line (a file may be missing: no run yet, no eval).
METRICS_SCRIPT = r'''
dir=$1/$2
[ -d "$dir" ] || { echo "dflash: no run named $2 under $1" >&2; exit 3; }
echo "== metrics"
cat "$dir/metrics.jsonl" 2>/dev/null
echo "== evals"
cat "$dir/evals.jsonl" 2>/dev/null
echo "== end"
'''
EXIT_NO_RUN = 3


@dataclass
class RunMetrics:
    run: str
    train: list = field(default_factory=list)
    eval: list = field(default_factory=list)
    checkpoints: list = field(default_factory=list)
    dflash_evals: list = field(default_factory=list)
    skipped: int = 0  # lines that were not JSON objects (one being written as we read it)


def parse_metrics(text: str, run: str = "") -> RunMetrics:
    """Output of METRICS_SCRIPT -> RunMetrics. Pure; a torn or foreign line is counted, not fatal."""
    out = RunMetrics(run)
    section = None
    for line in text.splitlines():
        if line.startswith("== "):
            section = line[3:].strip()
            continue
        if not line.strip() or section not in ("metrics", "evals"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step", 0), (int, type(None))):
            out.skipped += 1
            continue
        if section == "evals":
            out.dflash_evals.append(record)
            continue
        bucket = {"train": out.train, "eval": out.eval, "checkpoint": out.checkpoints}.get(
            record.get("kind", "train"))
        if bucket is None:
            out.skipped += 1
        else:
            bucket.append(record)
    return out


def fetch(t, run: str | None = None) -> RunMetrics | None:
    """Read run `run` (default: the latest) from the container; None in a dry run."""
    ct = t.container
    name = jobs.resolve_run(t, run)
    result = t.session.exec(ct, commands.sh_script(METRICS_SCRIPT, ct.paths.runs, name), check=False)
    if t.dry_run:
        return None
    if result.exited == EXIT_NO_RUN:
        from .errors import RunStateError
        raise RunStateError(f"{ct.label}: {result.stderr.strip()}; `invoke status` names the latest run")
    if result.exited != 0:
        from .errors import RemoteCommandFailed
        raise RemoteCommandFailed(f"{ct.label}: reading metrics failed (exit {result.exited}): "
                                  f"{result.stderr.strip()[-300:]}", exited=result.exited)
    return parse_metrics(result.stdout, name)


# --- the table ------------------------------------------------------------------------------------

def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _slots(record: dict, count: int = 4) -> str:
    accuracy = record.get("slot_accuracy") or []
    return " ".join(f"{a:.2f}" for a in accuracy[:count]) or "-"


def table(metrics: RunMetrics, n: int = 20):
    """A rich Table of the last `n` logged steps, held-out evaluations merged in by step."""
    from rich import box
    from rich.table import Table

    evals = {r["step"]: r for r in metrics.eval}
    rows = metrics.train[-n:] if n > 0 else metrics.train
    # a light box without vertical rules: the table fits 80 columns
    out = Table(title=f"run {metrics.run}: last {len(rows)} of {len(metrics.train)} logged steps",
                title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name in ("step", "loss", "held-out", "accept", "slot acc 1-4", "tokens/s", "lr", "GiB"):
        out.add_column(name, justify="left" if name == "slot acc 1-4" else "right", no_wrap=True)
    for record in rows:
        held = evals.get(record.get("step"))
        out.add_row(str(record.get("step", "-")), _f(record.get("loss"), ".4f"),
                    _f(held and held.get("loss"), ".4f"), _f(record.get("acceptance_length"), ".2f"),
                    _slots(record), _f(record.get("tokens_per_s"), ",.0f"), _f(record.get("lr"), ".1e"),
                    _f(record.get("memory_gib"), ".2f"))
    return out


def eval_summary(metrics: RunMetrics) -> str | None:
    """One line about the last dflash_generate evaluation, if there is one."""
    if not metrics.dflash_evals:
        return None
    last = metrics.dflash_evals[-1]
    return (f"last dflash eval (step {last.get('step')}): acceptance {last['acceptance_length']:.2f}, "
            f"{last['tokens_per_target_forward']:.2f} tokens/target forward, speedup "
            f"{last['speedup']:.2f}x, lossless {'yes' if last['lossless'] else 'NO'}")


# --- the plot -------------------------------------------------------------------------------------

def _smooth(values: list[float], points: int) -> list[float]:
    """Exponential moving average whose window grows with the run (raw values when short)."""
    if points < 40:
        return values
    alpha, out, level = min(1.0, 10.0 / points), [], None
    for v in values:
        level = v if level is None else level + alpha * (v - level)
        out.append(level)
    return out


def _series(records: list[dict], key: str):
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None and r.get("step") is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot(metrics: RunMetrics, path: str) -> str:
    """Loss, acceptance length, per-slot accuracy and throughput against step, in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import cm
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    if not metrics.train and not metrics.eval:
        from .errors import RunStateError
        raise RunStateError(f"run {metrics.run} has no metrics yet: nothing to plot")
    train, held = metrics.train, metrics.eval
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), dpi=110, constrained_layout=True)
    (ax_loss, ax_tau), (ax_slot, ax_speed) = axes
    colour_train, colour_held, colour_eval = "#1f77b4", "#d62728", "#2ca02c"

    def curve(ax, records, key, colour, label):
        steps, values = _series(records, key)
        if not steps:
            return
        smooth = _smooth(values, len(values))
        if smooth is not values:
            ax.plot(steps, values, color=colour, alpha=0.25, linewidth=0.8)
        ax.plot(steps, smooth, color=colour, linewidth=2, label=label)

    def points(ax, records, key, colour, label, marker="o"):
        steps, values = _series(records, key)
        if steps:
            ax.plot(steps, values, color=colour, marker=marker, linestyle="--", linewidth=1.2,
                    markersize=6, label=label)

    curve(ax_loss, train, "loss", colour_train, "train")
    points(ax_loss, held, "loss", colour_held, "held-out")
    ax_loss.set_yscale("log")
    ax_loss.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))  # labels at 1, 2, 5, 10, 20, 50
    ax_loss.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax_loss.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    ax_loss.set_title("Loss (decay-weighted cross-entropy)", loc="left", fontweight="bold")

    curve(ax_tau, train, "acceptance_length", colour_train, "train (teacher-forced)")
    points(ax_tau, held, "acceptance_length", colour_held, "held-out (teacher-forced)")
    evals = [r for r in metrics.dflash_evals if r.get("step") is not None]
    if evals:
        steps, values = _series(evals, "acceptance_length")
        ax_tau.scatter(steps, values, marker="*", s=260, color=colour_eval, zorder=5,
                       edgecolor="black", linewidth=0.6, label="dflash_generate (greedy, lossless)")
        for s, v in zip(steps, values):
            ax_tau.annotate(f"{v:.2f}", (s, v), textcoords="offset points", xytext=(8, -12),
                            color=colour_eval, fontweight="bold")
    ax_tau.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax_tau.set_title("Acceptance length τ (tokens per verification)", loc="left", fontweight="bold")

    slots = max((len(r.get("slot_accuracy") or []) for r in train), default=0)
    colours = cm.viridis([i / max(slots - 1, 1) for i in range(slots)])
    for slot in range(slots):
        rows = [r for r in train if len(r.get("slot_accuracy") or []) > slot]
        steps = [r["step"] for r in rows]
        values = [r["slot_accuracy"][slot] for r in rows]
        label = f"slot {slot + 1}" if slot in (0, slots - 1) or slots <= 8 else None
        ax_slot.plot(steps, _smooth(values, len(values)), color=colours[slot], linewidth=1.6, label=label)
    ax_slot.set_ylim(0, 1)
    ax_slot.set_title("Per-slot accuracy (slot k predicts token anchor+k)", loc="left", fontweight="bold")

    curve(ax_speed, train, "tokens_per_s", "#9467bd", "tokens/s")
    ax_speed.set_ylim(bottom=0)
    ax_speed.set_title("Throughput (target tokens/s) and learning rate", loc="left", fontweight="bold")
    steps, lrs = _series(train, "lr")
    if steps:
        ax_lr = ax_speed.twinx()
        ax_lr.plot(steps, lrs, color="grey", linestyle="--", linewidth=1, label="lr")
        ax_lr.set_ylabel("learning rate", color="grey")
        ax_lr.tick_params(axis="y", colors="grey")
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        ax_lr.set_ylim(bottom=0)
        handles = [h for ax in (ax_speed, ax_lr) for h in ax.get_legend_handles_labels()[0]]
        ax_speed.legend(handles=handles, loc="lower left", fontsize=9, framealpha=0.8)

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
    headline = (f"run {metrics.run}: step {last.get('step')}, loss {last.get('loss', 0):.3f}, "
                f"τ {last.get('acceptance_length', 0):.2f}")
    if evals:
        headline += f"; dflash eval τ {evals[-1]['acceptance_length']:.2f} at step {evals[-1]['step']}"
    fig.suptitle(headline + ("   (grey lines: checkpoints)" if saved else ""), fontsize=13)
    fig.savefig(path)
    plt.close(fig)
    return path

"""`invoke plan`: which layout of the container's GPUs trains fastest, from per-device measurements.

The container measures two figures (remote_scripts/plan_layout.py, about a minute): the target's
forward tokens/s on one device and one drafter worker's training-step tokens/s on one device, at
the configured shapes, plus the memory one full copy of the target needs. `layouts()` turns them
into the expected pipeline tokens/s of every candidate layout; it is pure, so the figures can come
from the container or from a benchmark (bench/RESULTS.md computes the 8-GPU table from the H200's).

The model, per training step (each drafter worker trains on one batch of batch_size x seq tokens):
- drafter side: d workers, each on its own device: d x drafter_tok_s;
- target side, `replicate` over k devices: worker w's batch is made on replica w % k, the replicas
  at once, so a step takes ceil(d / k) target forwards: target_tok_s x d / ceil(d / k);
- target side, `split` over k devices: one device works at a time: target_tok_s (the layers'
  hand-offs cost a little more; not modelled);
- pipeline: the target prefetches step n+1 while the drafters train on step n, so the slower
  side sets the pace: min(target side, drafter side). Measured on 2 H200s (split, 8B-class):
  91% of the drafter side alone.
A layout whose target copy does not fit a device (replicate: the whole copy; split: 1/k of the
weights plus the activations) is listed with 0 and marked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import yaml

from .errors import DflashOpsError
from .remote.prelude import PLAN_FILE  # in paths.runs: the last measurement, which doctor compares with

LAGGING = 0.7  # doctor warns when the configured layout expects less than this share of the best


@dataclass(frozen=True)
class Measured:
    gpus: int                 # GPUs the container has
    target_tok_s: float       # one full target copy's forward on one device
    drafter_tok_s: float      # one drafter worker's step (fwd + bwd + update) on one device
    weights_gib: float        # the target's weights
    activations_gib: float    # one forward's working memory
    device_gib: float         # memory of one device


@dataclass(frozen=True)
class Layout:
    target: int               # target devices (the first k GPUs)
    drafters: int             # drafter devices (the rest), one worker each
    placement: str            # replicate | split
    target_side: float
    drafter_side: float
    fits: bool

    @property
    def expected(self) -> float:
        return min(self.target_side, self.drafter_side) if self.fits else 0.0

    @property
    def bound(self) -> str:
        if not self.fits:
            return "does not fit"
        return "target" if self.target_side < self.drafter_side else "drafters"

    def roles(self) -> dict:
        return {"target": list(range(self.target)),
                "drafter": list(range(self.target, self.target + self.drafters))}

    def row(self) -> list[str]:
        return [f"{self.target}+{self.drafters}", self.placement, f"{self.target_side:,.0f}",
                f"{self.drafter_side:,.0f}", f"{self.expected:,.0f}", self.bound]


def layout(m: Measured, target: int, placement: str) -> Layout:
    drafters = m.gpus - target
    if placement == "replicate":
        target_side = m.target_tok_s * drafters / math.ceil(drafters / target)
        fits = m.weights_gib + m.activations_gib <= m.device_gib
    else:
        target_side = m.target_tok_s
        fits = m.weights_gib / target + m.activations_gib <= m.device_gib
    return Layout(target, drafters, placement, target_side, drafters * m.drafter_tok_s, fits)


def layouts(m: Measured) -> list[Layout]:
    """Every k target + (n - k) drafter split of the GPUs, replicate and split (the same on k = 1)."""
    out = []
    for target in range(1, m.gpus):
        out.append(layout(m, target, "replicate"))
        if target > 1:
            out.append(layout(m, target, "split"))
    return out


def best(candidates: list[Layout]) -> Layout:
    """The fastest; on a tie, fewer target devices, then replicate."""
    return max(candidates, key=lambda c: (round(c.expected), -c.target, c.placement == "replicate"))


def hours_per_steps(candidate: Layout, steps: int, tokens_per_batch: int) -> float:
    """Wall hours for `steps` steps (each worker trains on one batch per step)."""
    if not candidate.expected:
        return math.inf
    return steps * candidate.drafters * tokens_per_batch / candidate.expected / 3600


def table(candidates: list[Layout]) -> str:
    head = ["layout", "placement", "target side tok/s", "drafter side tok/s", "expected tok/s",
            "bound by"]
    rows = [head, *(c.row() for c in candidates)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) if i > 1 and j else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
                     for j, r in enumerate(rows))


def fragment(ctid: int, choice: Layout, m: Measured) -> str:
    """The best layout as YAML to merge by hand: the container's roles, the config's placement."""
    header = (f"# invoke plan for container {ctid}: {choice.target}+{choice.drafters} {choice.placement}, "
              f"expected {choice.expected:,.0f} tok/s (target {m.target_tok_s:,.0f} and drafter "
              f"{m.drafter_tok_s:,.0f} tok/s per device, measured)\n"
              "# inventory: merge `containers` into your inventory file; training config: merge "
              "`train_config` into the container's train_config file.\n")
    body = {"containers": {ctid: {"roles": choice.roles()}},
            "train_config": {"target": {"placement": choice.placement}}}
    return header + yaml.safe_dump(body, sort_keys=False, default_flow_style=None)


def configured(m: Measured, target_gpus: int, placement: str) -> Layout:
    """The layout the inventory and config ask for (auto: replicate when a copy fits)."""
    if placement == "auto":
        placement = "replicate" if m.weights_gib + m.activations_gib <= m.device_gib else "split"
    return layout(m, target_gpus, "replicate" if target_gpus == 1 else placement)


def lagging(m: Measured, target_gpus: int, placement: str) -> str | None:
    """A one-line warning when the configured layout expects < LAGGING of the best, else None."""
    mine, top = configured(m, target_gpus, placement), best(layouts(m))
    if not top.expected or mine.expected >= LAGGING * top.expected:
        return None
    return (f"configured {mine.target}+{mine.drafters} {mine.placement} expects "
            f"{mine.expected:,.0f} tok/s, {100 * (1 - mine.expected / top.expected):.0f}% below "
            f"{top.target}+{top.drafters} {top.placement} ({top.expected:,.0f} tok/s)")


# --- the task: measure in the container, then the table -----------------------------------------

PLAN_SCRIPT = "plan_layout.py"


MAX_GPUS = 64  # more devices than any one host has: a plan.json naming more is not a measurement


def measured_from(record: dict, gpus: int | None = None) -> Measured:
    """plan.json's measurement (the container's file: every field checked); ValueError naming the field."""
    def number(name: str) -> float:
        value = record.get(name) if isinstance(record, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e15:
            raise ValueError(f"plan.json: field {name!r} is not a measured number")
        return float(value)

    gpus = gpus or (record.get("gpus") if isinstance(record, dict) else None)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= MAX_GPUS:
        raise ValueError(f"plan.json: field 'gpus' is not a GPU count (0 to {MAX_GPUS})")
    return Measured(gpus=gpus, target_tok_s=number("target_tok_s"), drafter_tok_s=number("drafter_tok_s"),
                    weights_gib=number("weights_gib"), activations_gib=number("activations_gib"),
                    device_gib=number("device_gib"))


def plan_argv(ct, config: str | None = None, sets=()) -> list[str]:
    """Pure: the training argv (same config, sets and devices as `train`) of plan_layout.py."""
    from . import payload

    return [*payload.payload_argv(ct, PLAN_SCRIPT, config, sets), f"--save={ct.paths.runs}/{PLAN_FILE}"]


def report(ct, record: dict, steps: int = 20_000) -> tuple[list[Layout], Layout, str]:
    """(candidates, best, the text `invoke plan` prints) for one measurement."""
    m = measured_from(record, record.get("gpus") or len(ct.roles.gpus))
    if m.gpus < 2:
        from .errors import UsageError
        raise UsageError(f"{ct.label}: {m.gpus} GPU(s): a layout needs one target and one drafter device")
    candidates = layouts(m)
    choice = best(candidates)
    tokens = int(record["tokens_per_batch"])
    mine = configured(m, len(record["configured"]["target_devices"]), record["configured"]["placement"])
    from .terminal import visible  # device names come from the container: text, not markup

    lines = [f"measured on {ct.label}: target {m.target_tok_s:,.0f} tok/s per device "
             f"({visible(str(record['target_device']))}), drafter step {m.drafter_tok_s:,.0f} tok/s "
             f"per device ({visible(str(record['drafter_device']))}); one target copy "
             f"{m.weights_gib:.1f} GiB + {m.activations_gib:.1f} GiB activations of {m.device_gib:.0f} GiB",
             "",
             table(candidates), "",
             f"best: {choice.target}+{choice.drafters} {choice.placement}, {choice.expected:,.0f} tok/s, "
             f"{hours_per_steps(choice, steps, tokens):.1f} h per {steps:,} steps",
             f"configured: {mine.target}+{mine.drafters} {mine.placement}, {mine.expected:,.0f} tok/s, "
             f"{hours_per_steps(mine, steps, tokens):.1f} h per {steps:,} steps"]
    return candidates, choice, "\n".join(lines)


def write_fragment(path: str, ctid: int, choice: Layout, m: Measured) -> None:
    """A new file only: never an existing one (an inventory is edited by its owner, not by us)."""
    import os

    from .errors import UsageError

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise UsageError(f"--write {path}: the file exists; plan writes a new file, never over "
                         "one (merge the fragment into your inventory yourself)") from None
    with os.fdopen(fd, "w") as f:
        f.write(fragment(ctid, choice, m))


@dataclass
class Planned:
    """`invoke plan`: the measurement, the layouts' table, the best and the configured one."""

    record: dict
    text: str
    best: Layout
    written: str | None = None
    error: Exception | None = None  # --write refused: the measurement is shown all the same

    def describe(self) -> str:
        if self.written:
            return f"{self.text}\nwrote {self.written}: merge it into your inventory and training config"
        return self.text

    def facts(self) -> dict:
        b = self.best
        return {"measured": self.record, "written": self.written,
                "best": {"roles": b.roles(), "placement": b.placement, "expected_tokens_per_s": b.expected,
                         "bound": b.bound}}

    def row(self) -> str:
        b = self.best
        return f"best {b.target}+{b.drafters} {b.placement}, {b.expected:,.0f} tok/s"


def plan(t, config: str | None = None, sets=(), write: str | None = None, echo=print,
         timeout: float | None = None) -> Planned | None:
    """Measure in the container (about a minute, progress shown; within `timeout` s, payload.TIMEOUTS'
    by default): the layouts and the best."""
    from . import payload

    ct = t.container
    timeout = payload.timeout_of("plan", timeout)
    _, found = payload.run_script(t, plan_argv(ct, config, sets), "plan", timeout, echo)
    if t.dry_run:
        return None
    record = found[-1]
    candidates, choice, text = report(ct, record)
    if not write:
        return Planned(record, text, choice)
    try:
        measured = measured_from(record, record.get("gpus") or len(ct.roles.gpus))
        write_fragment(write, ct.ctid, choice, measured)
    except DflashOpsError as exc:
        return Planned(record, text, choice, error=exc)
    return Planned(record, text, choice, write)

"""`invoke eval` and `invoke regenerate`: the payload's eval_dflash.py / regenerate_data.py in the container.

Both run in the foreground with the run environment (`Container.run_env`), their progress lines
streamed, and end with one `RESULT <json>` line that is parsed here (the JSON line itself is not
shown). One round trip each.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass

from . import payload, runs
from .errors import DflashOpsError, ExitStatus, NoSuchRun, PreflightFailed, RunStateError, UsageError
from .inventory import Container

EVAL_SCRIPT = "eval_dflash.py"
REGENERATE_SCRIPT = "regenerate_data.py"
EXIT_NOT_LOSSLESS = 3  # eval_dflash.py's exit code when speculative decoding changed an output
DEFAULT_SOURCES = ("data/train.jsonl", "data/heldout.jsonl")  # relative to paths.code


class NotLossless(DflashOpsError, exit_status=ExitStatus.NOT_LOSSLESS):
    """Speculative decoding changed the target's greedy output: the drafter/target pairing is broken."""


def _first_device(ct: Container) -> str:
    return (ct.roles.devices("target") or "cpu").split(",")[0]


def _option(name: str, value) -> list[str]:
    return [] if value is None else [f"--{name}={value}"]


def eval_argv(ct: Container, run: str, checkpoint: str = "latest", prompts: str | None = None,
              num_prompts: int | None = None, max_new_tokens: int | None = None,
              device: str | None = None) -> list[str]:
    """Pure. `--opt=value` throughout, so no value is read as an option."""
    if not checkpoint or checkpoint.startswith("-") or "\n" in checkpoint:
        raise UsageError(f"--checkpoint {checkpoint!r}: give latest, step-N, init or a directory in the "
                         "container")
    for name, value in (("num-prompts", num_prompts), ("max-new-tokens", max_new_tokens)):
        if value is not None and int(value) < 1:
            raise UsageError(f"--{name} {value}: must be >= 1")
    return [ct.venv_python, f"{ct.paths.code}/{EVAL_SCRIPT}", f"--run-dir={runs.run_dir(ct, run)}",
            f"--checkpoint={checkpoint}", *_option("prompts", prompts),
            *_option("num-prompts", num_prompts), *_option("max-new-tokens", max_new_tokens),
            *_option("device", device or _first_device(ct))]


def _jsonl_name(source: str) -> str:
    """The output's name: the source's, as JSONL (a.parquet, a.jsonl.gz, a/ -> a.jsonl)."""
    name = posixpath.basename(source.rstrip("/"))
    for suffix in (".jsonl.gz", ".parquet", ".jsonl", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".jsonl"
    return name + ".jsonl"


def regenerate_argv(ct: Container, sources: Sequence[str] = (), out_dir: str | None = None,
                    max_new_tokens: int | None = None, limit: int | None = None,
                    batch_size: int | None = None, device: str | None = None,
                    dtype: str | None = None, target: str | None = None, samples: int | None = None,
                    temperature: float | None = None, seed: int | None = None,
                    self_prompts: int | None = None, extend: bool = False,
                    lead_words: int | None = None) -> tuple[list[str], list[str]]:
    """Pure: (argv, output paths). Each source (relative paths: under paths.code; any format the
    payload reads, a directory of shards too) is written to out_dir/<its name>.jsonl; out_dir defaults to
    `data/` beside paths.runs; target to paths.model. samples, temperature, seed and self_prompts
    apply to the first source (the training split); lead_words K: each self prompt opens with the
    first 1..K words of one of its human-written prompts; extend: the sources are this target's
    answers already, kept, and only the new self prompts are answered."""
    for name, value in (("samples", samples), ("self-prompts", self_prompts),
                        ("lead-words", lead_words)):
        if value is not None and int(value) < 0:
            raise UsageError(f"--{name} {value}: must be >= 0")
    if lead_words and not self_prompts:
        raise UsageError(f"--lead-words {lead_words}: goes with --self-prompts N")
    if temperature is not None and not float(temperature) > 0:
        raise UsageError(f"--temperature {temperature}: must be > 0")
    sources = [s if s.startswith("/") else f"{ct.paths.code}/{s}" for s in (sources or DEFAULT_SOURCES)]
    out_dir = out_dir or posixpath.join(posixpath.dirname(ct.paths.runs.rstrip("/")), "data")
    outputs = [posixpath.join(out_dir, _jsonl_name(s)) for s in sources]
    if len(set(outputs)) != len(outputs):
        raise UsageError(f"--src files must have different names (they all go to {out_dir}/)")
    device = device or _first_device(ct)
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    argv = [ct.venv_python, f"{ct.paths.code}/{REGENERATE_SCRIPT}", f"--target={target or ct.paths.model}",
            f"--device={device}", f"--dtype={dtype}", *_option("max-new-tokens", max_new_tokens),
            *_option("limit", limit), *_option("batch-size", batch_size), *_option("samples", samples),
            *_option("temperature", temperature), *_option("seed", seed),
            *_option("self-prompts", self_prompts), *_option("lead-words", lead_words),
            *(["--extend"] if extend else [])]
    for source, output in zip(sources, outputs, strict=True):
        argv += [f"--in={source}", f"--out={output}"]
    return argv, outputs


def eval_needs(ct: Container, run: str, checkpoint: str, prompts: str | None) -> list[payload.Need]:
    """What eval_dflash.py needs, checked before it starts (payload.require): the run, its
    checkpoint (latest, step-N, init or a directory), the prompts file when given."""
    run_dir = runs.run_dir(ct, run)
    if checkpoint == "latest":  # a pointer file, or the highest complete step: the script resolves it
        needed, test, checkpoint_dir = f"{run_dir}/checkpoints", "d", f"{run_dir}/checkpoints"
    elif checkpoint == "init":  # the untrained drafter: the script builds it from the run's config
        needed, test, checkpoint_dir = f"{run_dir}/config.yaml", "f", f"{run_dir}/config.yaml"
    else:
        checkpoint_dir = checkpoint if "/" in checkpoint else f"{run_dir}/checkpoints/{checkpoint}"
        needed, test = f"{checkpoint_dir}/config.json", "f"
    needs = [payload.Need(run_dir, "d", NoSuchRun(  # evaluate() asks the container for its runs then
                 f"no run {run!r} on {ct.label} (in {ct.paths.runs}): `invoke runs` lists them")),
             payload.Need(needed, test, RunStateError(
                 f"run {run}: no checkpoint {checkpoint!r} on {ct.label} ({checkpoint_dir}); "
                 "`invoke runs` shows each run's latest"))]
    if prompts:
        needs.append(payload.Need(prompts, "f", PreflightFailed(
            f"{ct.label}: --prompts {prompts}: no such file in the container (relative paths are under "
            f"{ct.paths.code}); nothing was started")))
    return needs


def regenerate_needs(ct: Container, sources: Sequence[str], target: str | None) -> list[payload.Need]:
    """What regenerate_data.py needs, checked before it starts: every source, the target's config."""
    path = target or ct.paths.model
    fix = ("give --target DIR" if target else
           "run `invoke stage` (the target is gone from /dev/shm after a restart) or give --target DIR")
    needs = [payload.Need(f"{path}/config.json", "f", PreflightFailed(
        f"{ct.label}: target {path}: no such directory or no config.json in it; {fix}; nothing was started"))]
    for source in sources:
        needs.append(payload.Need(source, "e", PreflightFailed(
            f"{ct.label}: --src {source}: no such file or directory in the container (relative paths are "
            f"under {ct.paths.code}); nothing was started")))
    return needs


@dataclass
class Evaluation:
    """One evaluation's record; `error` is NotLossless when speculative decoding changed an output
    (the numbers are shown first)."""

    record: dict
    error: NotLossless | None = None

    def describe(self) -> str:
        return describe(self.record)

    def facts(self) -> dict:
        """--json: eval_dflash.py's record, as written to eval.json (exit 10 when not lossless)."""
        return self.record

    def row(self) -> str:
        return (f"acceptance {self.record['acceptance_length']:.2f}, speedup {self.record['speedup']:.2f}x, "
                + ("lossless" if self.error is None else "NOT LOSSLESS"))


# eval_dflash.py's one-line summary of its RESULT; `describe` shows the record in full instead.
EVAL_SUMMARY = "lossless "


def evaluate(t, run: str, echo=print, timeout: float | None = None, **options) -> Evaluation | None:
    """Run eval_dflash.py on run `run` within `timeout` s (payload.TIMEOUTS' by default); returns its
    Evaluation (None in a dry run)."""
    run = runs.validate_run_name(run)
    timeout = payload.timeout_of("eval", timeout)
    argv = eval_argv(t.container, run, **options)  # bad flags: one line before anything is sent
    try:
        payload.require(t, eval_needs(t.container, run, options.get("checkpoint") or "latest",
                                      options.get("prompts")))
    except NoSuchRun:
        from .history import require_run

        require_run(t, run)  # the one unknown-run line, with the runs there are
        raise
    result, found = payload.run_script(t, argv, "evaluation", timeout, echo,
                                       ok=(0, EXIT_NOT_LOSSLESS), summary=(EVAL_SUMMARY,))
    if t.dry_run:
        return None
    record = found[-1]
    if result.exited == EXIT_NOT_LOSSLESS or not record.get("lossless"):
        return Evaluation(record, NotLossless(
            f"run {run}: speculative output differs from plain greedy decoding on prompts "
            f"{record.get('mismatched_prompts')}; check that the drafter was trained "
            f"against this target (config.json's dflash_config, the target's dtype)"))
    return Evaluation(record)


@dataclass
class Regenerated:
    """regenerate_data.py's stats, one dict per output file."""

    files: list

    def describe(self) -> str:
        return "\n".join(describe_regeneration(stats) for stats in self.files)

    def facts(self) -> dict:
        return {"files": self.files}

    def row(self) -> str:
        return ", ".join(f"{stats['out']}: {stats['rows']} rows" for stats in self.files)


def regenerate(t, echo=print, timeout: float | None = None, **options) -> Regenerated | None:
    """Run regenerate_data.py in the container within `timeout` s (payload.TIMEOUTS' by default);
    None in a dry run."""
    timeout = payload.timeout_of("regenerate", timeout)
    argv, _ = regenerate_argv(t.container, **options)
    payload.require(t, regenerate_needs(t.container, options.get("sources") or DEFAULT_SOURCES,
                                        options.get("target")))
    _, found = payload.run_script(t, argv, "regeneration", timeout, echo)
    return None if t.dry_run else Regenerated(found)


def describe_regeneration(stats: dict) -> str:
    """One line per regenerated file; a warning when the answers look like a random model's."""
    line = (f"{stats['out']}: {stats['rows']} rows, {stats['changed']} of {stats['turns']} answers changed, "
            f"{stats['truncated']} cut at the token limit")
    if stats["turns"] and stats["truncated"] > stats["turns"] / 2:
        line += ("\n  warning: most answers never ended (no end-of-turn token): a random target repeats "
                 "itself; a tiny target should be fitted first (make_tiny_target.py --fit-steps 200)")
    return line


def describe(record: dict) -> str:
    """The numbers of one evaluation, a few lines for a person."""
    hist = record.get("acceptance_histogram") or []
    return "\n".join([
        f"checkpoint          {record['checkpoint']}",
        f"target              {record['target']} on {record['device']} ({record['dtype']})",
        f"prompts             {record['prompts']} held-out (<= {record['max_new_tokens']} new tokens each, "
        f"{record['new_tokens']} in all)",
        "lossless            " + ("yes" if record["lossless"] else
                                     f"NO: prompts {record['mismatched_prompts']} differ from token "
                                     f"{record.get('first_divergence')} on"),
        f"acceptance length   {record['acceptance_length']:.2f} tokens per verification "
        f"(block size {record['block_size']})",
        f"tokens per forward  {record['tokens_per_target_forward']:.2f} "
        f"({record['target_forwards']['spec']} target forwards vs "
        f"{record['target_forwards']['plain']} plain)",
        f"speedup             {record['speedup']:.2f}x wall clock ({record['plain_tokens_per_s']:.1f} -> "
        f"{record['spec_tokens_per_s']:.1f} tokens/s)",
        "accepted per step   " + " ".join(f"{n}:{c}" for n, c in enumerate(hist, 1) if c),
        *([f"at the limit        {limit}"] if (limit := at_limit(record)) else []),
    ])


def at_limit(record: dict) -> str | None:
    """How many answers ran to max_new_tokens, and the acceptance length on those and on the rest
    (from per_prompt: each prompt's [new tokens, verification steps]; a prompt's first token comes
    from the prefill, its others from its steps). Answers that run to the limit can score unlike
    the rest (a small model restating itself; text past the lengths the drafter was trained on):
    this shows how much of the mean comes from them; the count alone when none or all of them did.
    None when the record has no usable per_prompt."""
    rows, limit = record.get("per_prompt"), record.get("max_new_tokens")
    if not isinstance(rows, list) or not rows or type(limit) is not int:
        return None
    if not all(isinstance(row, list) and len(row) == 2 and all(type(n) is int and n >= 0 for n in row)
               for row in rows):
        return None

    def mean(part):
        steps = sum(s for _, s in part)
        return f"{sum(max(t - 1, 0) for t, _ in part) / steps:.2f}" if steps else "-"

    full = [row for row in rows if row[0] >= limit]
    rest = [row for row in rows if row[0] < limit]
    if not full or not rest:  # one side empty: its mean is the record's own, the count says it all
        return f"{len(full)} of {len(rows)} answers reached {limit} new tokens"
    return (f"{len(full)} of {len(rows)} answers reached {limit} new tokens (acceptance length "
            f"{mean(full)} on those, {mean(rest)} on the rest)")

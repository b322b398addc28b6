"""Every parser of what a container sends answers with a value or a one-line error, never a traceback:
hypothesis feeds them arbitrary text and arbitrary JSON (malformed numbers, strings where numbers go,
nulls, deep nesting, huge values), shaped like the answers of remote/runs.py's verbs."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from dflash_ops import cli, launch, metrics, status
from dflash_ops.errors import DflashOpsError
from dflash_ops.inventory import parse_inventory
from dflash_ops.remote import readings, ship
from dflash_ops.remote.prelude import STATES

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

numbers = st.one_of(st.integers(), st.integers(min_value=10 ** 18, max_value=10 ** 30), st.floats(),
                    st.just(1e308), st.just(float("nan")), st.just(float("inf")))
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=30))
values = st.recursive(scalars,
                      lambda inner: st.one_of(st.lists(inner, max_size=4),
                                              st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=20)
deep = st.integers(min_value=1, max_value=5000).map(lambda n: "[" * n + "]" * n)
KEYS = ["kind", "step", "loss", "acceptance_length", "slot_accuracy", "tokens_per_s", "lr", "memory_gib",
        "tokens_per_target_forward", "speedup", "lossless", "prompts", "time", "path"]
records = st.dictionaries(st.sampled_from(KEYS), values, max_size=8)
record_lines = st.one_of(records.map(json.dumps), st.text(max_size=80), deep,
                         st.integers(min_value=4300, max_value=6000).map(
                             lambda n: '{"step": ' + "9" * n + "}"))
run_files = st.dictionaries(st.sampled_from(["pid", "pgid", "started", "ended", "exit_code", "stopped",
                                             "code_version"]), st.one_of(values, st.text(max_size=40)))
status_answers = st.fixed_dictionaries({}, optional={
    "now": values, "name": st.one_of(st.text(max_size=20), values), "exists": values, "alive": values,
    "files": st.one_of(run_files, values), "mtime_log": values, "mtime_metrics": values, "free": values,
    "metrics": st.one_of(st.lists(record_lines, max_size=6), values),
    "eval": st.one_of(records.map(json.dumps), deep, values),
    "log": st.one_of(st.lists(st.text(), max_size=5), values),
    "gpus": st.one_of(st.lists(st.text(max_size=40), max_size=3), values),
    "state": st.one_of(st.sampled_from(STATES), values), "detail": values, "idle_s": values})
refusals = st.fixed_dictionaries({"error": values}, optional={"message": values, "run": values})


def replies(answers):
    """What a verb prints: {"ok": answer}, a refusal, or anything a hostile interpreter prints."""
    return st.one_of(answers.map(lambda a: json.dumps({"ok": a})), refusals.map(json.dumps),
                     values.map(json.dumps))
metrics_answers = st.fixed_dictionaries({}, optional={
    "run": values, "metrics": st.one_of(st.lists(record_lines, max_size=8), values),
    "evals": st.one_of(st.lists(record_lines, max_size=4), values), "metrics_left_out": values,
    "metrics_dropped": values, "evals_dropped": values})


def one_line(exc: Exception) -> None:
    assert "\n" not in str(exc) and str(exc)


@SETTINGS
@given(st.one_of(replies(status_answers), st.text(), deep,
                 st.binary().map(lambda b: b.decode("latin-1"))))
def test_status_parser_answers_a_status_or_one_line(text):
    try:
        parsed = status.parse_status(text)
    except (ValueError, DflashOpsError) as exc:
        return one_line(exc)
    assert parsed.state in ("none", "missing", "running", "stalled", "finished", "crashed", "stopped")
    json.loads(cli.as_json_text(parsed.facts()))
    console = Console(record=True, width=100, file=open("/dev/null", "w"))
    status.render(parsed, "pve1/200", console)  # rich markup in any of it must not break the table


@SETTINGS
@given(st.one_of(replies(metrics_answers), st.text(), deep))
def test_metrics_parser_answers_metrics_or_one_line(text):
    try:
        parsed = metrics.parse_metrics(text, "r")
    except (ValueError, DflashOpsError) as exc:
        return one_line(exc)
    console = Console(record=True, width=100, file=open("/dev/null", "w"))
    console.print(metrics.table(parsed, 5))
    metrics.eval_summary(parsed)


def test_the_plot_of_hostile_records_draws_what_is_a_number(tmp_path):
    lines = [json.dumps({"kind": "train", "step": 1, "loss": "x", "slot_accuracy": [None, "a"], "lr": [1]}),
             json.dumps({"kind": "train", "step": 2, "loss": 1e308, "acceptance_length": 1.5,
                         "tokens_per_s": 9}),
             '{"kind": "eval", "loss": 2}', '{"kind": "train", "step": 3, "loss": NaN}',
             '{"kind": "checkpoint", "step": "7"}']
    evals = [json.dumps({"step": 2, "acceptance_length": "high", "speedup": None})]
    parsed = metrics.parse_metrics(json.dumps({"ok": {"metrics": lines, "evals": evals}}), "r")
    assert "acceptance -" in metrics.eval_summary(parsed)
    assert metrics.plot(parsed, str(tmp_path / "p.png")).endswith("p.png")


@SETTINGS
@given(st.one_of(st.text(), values.map(json.dumps), deep))
def test_the_one_answer_reader_answers_a_value_or_one_line(text):
    try:
        ship.answer(text, "pve1/200: t")
    except DflashOpsError as exc:
        one_line(exc)
        assert str(exc).startswith("pve1/200: t: ")


CT = parse_inventory({"hosts": {"pve1": {"address": "pve1.example"}},
                      "containers": {200: {"host": "pve1", "roles": {"target": ["cpu"], "drafter": ["cpu"]}}}}
                     ).container(200)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["error", "message", "run", "check", "fix", "outcome"]), values))
def test_refusals_become_one_line_errors(answer):
    try:
        launch.refused(CT, answer, "launch")
    except DflashOpsError as exc:
        one_line(exc)
        assert "\x1b" not in str(exc)


@SETTINGS
@given(st.lists(st.one_of(st.text(), values.map(json.dumps), deep), max_size=6))
def test_the_launch_watch_takes_lines_and_a_verdict_from_anything(raw):
    watch = launch.LaunchWatch("r", "pve1/200", 10, console=Console(file=open("/dev/null", "w")))
    watch.write("\n".join(raw) + "\n")
    assert all(isinstance(line, str) for line in watch.lines) and isinstance(watch.verdict, dict)
    assert isinstance(launch.refusal(raw[:1]), dict)


@SETTINGS
@given(st.one_of(st.none(), values, st.fixed_dictionaries({"python": values, "torch": st.one_of(
    values, st.fixed_dictionaries({"rc": values, "out": st.one_of(st.text(), values.map(json.dumps)),
                                   "err": values}))})))
def test_torch_info_reads_any_venv_fact(fact):
    info = readings.torch_info(fact if isinstance(fact, dict) or fact is None
                            else {"torch": fact, "python": True})
    assert isinstance(info.ok, bool) and "\n" not in info.error

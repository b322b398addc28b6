"""metrics/eval/fetch pure parts: exact argv, the in-container scripts run here with a real sh on a
real run directory, the parsers on recorded output, the table and the plot (real matplotlib)."""

import json
import subprocess
import sys

import pytest
from recorded_answers import metrics_answer, status_answer

from dflash_ops import evaluate, fetch, metrics, payload
from dflash_ops.errors import NoSuchRun, RemoteCommandFailed, UsageError
from dflash_ops.inventory import parse_inventory
from dflash_ops.remote import ship

INVENTORY = {
    "hosts": {"pve1": {"address": "pve1.example"}},
    "containers": {
        200: {"host": "pve1", "roles": {"target": [0, 1], "drafter": [2]},
              "paths": {"code": "/root/my code", "venv": "/root/venv", "runs": "/root/runs",
                        "model": "/dev/shm/m"}},
        201: {"host": "pve1", "roles": {"target": ["cpu"], "drafter": ["cpu"]},
              "paths": {"code": "/c", "venv": "/v", "runs": "/srv/runs/", "model": "/m"}},
    },
}

# Recorded from a tiny CPU run (metrics.jsonl + evals.jsonl through METRICS_SCRIPT), with a line
# torn mid-write and a kind this version does not know.
RECORDED = """== metrics
{"kind": "eval", "step": 0, "loss": 16.55, "slot_accuracy": [0.0, 0.0, 0.0], "acceptance_length": 1.0, "time": 1}
{"kind": "train", "step": 25, "loss": 7.86, "slot_accuracy": [0.07, 0.07, 0.08], "acceptance_length": 1.08, "tokens_per_s": 1266.3, "lr": 0.005, "memory_gib": 0.45, "time": 2}
{"kind": "train", "step": 50, "loss": 3.38, "slot_accuracy": [0.15, 0.16, 0.17], "acceptance_length": 1.20, "tokens_per_s": 2422.5, "lr": 0.0049, "memory_gib": 0.45, "time": 3}
{"kind": "eval", "step": 50, "loss": 3.1, "slot_accuracy": [0.2, 0.2, 0.2], "acceptance_length": 1.3, "time": 3}
{"kind": "checkpoint", "step": 50, "path": "/root/runs/t/checkpoints/step-50", "replica_max_abs_diff": 0.0}
{"kind": "profile", "step": 50}
{"kind": "train", "step": 75, "loss": 2.9
== evals
{"kind": "dflash_eval", "step": 50, "acceptance_length": 2.08, "tokens_per_target_forward": 1.89, "speedup": 0.77, "lossless": true}
== end
"""  # noqa: E501


@pytest.fixture
def inv():
    return parse_inventory(INVENTORY)


# --- parsing, table, plot ---------------------------------------------------------------------------

def test_recorded_metrics_parse_by_kind_and_torn_lines_are_counted():
    m = metrics.parse_metrics(metrics_answer(RECORDED), "t")
    assert [r["step"] for r in m.train] == [25, 50]
    assert [r["step"] for r in m.eval] == [0, 50]
    assert [r["step"] for r in m.checkpoints] == [50]
    assert m.dflash_evals[0]["acceptance_length"] == 2.08
    assert m.skipped == 2  # the unknown kind and the torn last line


def test_table_shows_the_last_n_steps_with_held_out_loss_merged():
    from rich.console import Console

    m = metrics.parse_metrics(metrics_answer(RECORDED), "t")
    console = Console(width=150, record=True)
    console.print(metrics.table(m, n=1))
    text = console.export_text()
    assert "last 1 of 2 logged steps" in text
    narrow = Console(width=80, record=True)
    narrow.print(metrics.table(m, n=2))
    assert "0.15 0.16 0.17" in narrow.export_text()  # an 80-column terminal: cells not cut
    row = next(line for line in text.splitlines() if line.split()[:1] == ["50"])
    for cell in ("3.3800", "3.1000", "1.20", "0.15 0.16 0.17", "2,422", "4.9e-03"):
        assert cell in row, (cell, row)
    assert "acceptance 2.08" in metrics.eval_summary(m)
    assert metrics.eval_summary(metrics.parse_metrics(metrics_answer("== metrics\n== end\n"))) is None


def test_plot_writes_a_png_of_every_panel(tmp_path):
    m = metrics.parse_metrics(metrics_answer(RECORDED), "t")
    path = metrics.plot(m, str(tmp_path / "run.png"))
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    assert width > 1000 and height > 700


def test_plot_of_a_run_without_metrics_is_refused(tmp_path):
    from dflash_ops.errors import RunStateError

    with pytest.raises(RunStateError, match="no metrics yet"):
        metrics.plot(metrics.parse_metrics(metrics_answer("== metrics\n== end\n"), "empty"),
                     str(tmp_path / "x.png"))


def two_runs():
    first = metrics.parse_metrics(metrics_answer(RECORDED), "base")
    second = metrics.parse_metrics(metrics_answer(RECORDED.replace('"loss": 7.86', '"loss": 6.5')), "lr-high")
    return first, second


def test_several_runs_are_overlaid_one_line_each_with_a_legend(tmp_path):
    first, second = two_runs()
    fig = metrics.overlay_figure([first, second])
    loss, tau, held, speed = fig.axes
    for ax in (loss, tau, speed):
        assert [line.get_label() for line in ax.get_lines()] == ["base", "lr-high"]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["base", "lr-high"]
    assert [list(line.get_ydata()) for line in loss.get_lines()] == [[7.86, 3.38], [6.5, 3.38]]
    assert [list(line.get_xdata()) for line in held.get_lines()] == [[0, 50], [0, 50]]
    assert len(tau.collections) == 2  # each run's dflash evaluation, a star in its colour
    path = metrics.plot([first, second], str(tmp_path / "both.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def read_events(folder):
    """Every scalar of the TensorBoard event files in `folder`: {tag: [(step, value)]}, read back from
    the TFRecord framing (length, its crc, the Event proto, its crc) as TensorBoard reads it."""
    import struct

    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event

    def masked(data):
        crc = crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    scalars = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            head = data[at:at + 8]
            (length,), (head_crc,) = struct.unpack("<Q", head), struct.unpack("<I", data[at + 8:at + 12])
            body = data[at + 12:at + 12 + length]
            (body_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
            assert head_crc == masked(head) and body_crc == masked(body)
            event = Event.FromString(body)
            for value in event.summary.value:  # float32 values: compared at 4 decimals
                scalars.setdefault(value.tag, []).append((event.step, round(value.simple_value, 4)))
            at += 16 + length
    return scalars


def test_tensorboard_event_files_read_back_with_every_step_and_value(tmp_path):
    first, second = two_runs()
    written = metrics.export_tensorboard([first, second], str(tmp_path / "tb"))
    assert written == [str(tmp_path / "tb" / "base"), str(tmp_path / "tb" / "lr-high")]
    got = read_events(tmp_path / "tb" / "lr-high")
    assert got["train/loss"] == [(25, 6.5), (50, 3.38)]
    assert got["train/acceptance_length"] == [(25, 1.08), (50, 1.2)]
    assert got["train/slot_accuracy/3"] == [(25, 0.08), (50, 0.17)]
    assert got["heldout/loss"] == [(0, 16.55), (50, 3.1)]
    assert got["dflash_eval/acceptance_length"] == [(50, 2.08)]
    metrics.export_tensorboard([second], str(tmp_path / "tb"))  # again: replaces its own, not added to it
    assert read_events(tmp_path / "tb" / "lr-high") == got
    assert len(list((tmp_path / "tb" / "lr-high").iterdir())) == 1


def test_a_latest_run_name_that_is_no_run_name_is_not_a_directory(tmp_path):
    from dflash_ops.errors import UntrustedData

    odd = metrics.parse_metrics(metrics_answer(RECORDED), "../escape")
    with pytest.raises(UntrustedData):
        metrics.export_tensorboard([odd], str(tmp_path / "tb"))
    assert not (tmp_path / "escape").exists()


@pytest.mark.parametrize("path, said", [("/nonexistent/tb", "the directory /nonexistent does not exist"),
                                        ("/etc/hostname", "is not a directory")])
def test_a_bad_tensorboard_dir_is_one_line(path, said):
    with pytest.raises(UsageError, match=said):
        metrics.check_tensorboard_dir(path)


def run_verb(verb, payload):
    """remote/runs.py's verb through the exact loader and packed text the container gets."""
    argv = [sys.executable, "-S", "-c", ship.LOADER, ship.packed("runs"), verb, json.dumps(payload)]
    out = subprocess.run(argv, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_metrics_script_on_a_real_run_dir(tmp_path):
    run = tmp_path / "runs" / "t"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n')
    out = run_verb("metrics", {"runs": str(tmp_path / "runs"), "name": "t"})
    parsed = metrics.parse_metrics(out, "t")
    assert [r["loss"] for r in parsed.train] == [2.0] and parsed.dflash_evals == []
    missing = json.loads(run_verb("metrics", {"runs": str(tmp_path / "runs"), "name": "nope"}))
    assert (missing["error"], missing["name"], missing["runs"]) == ("no-run", "nope", ["t"])
    with pytest.raises(NoSuchRun, match=r"^no run 'nope' on pve1/200; runs: t$"):
        metrics.parse_metrics(json.dumps(missing), "nope", "pve1/200: metrics")


# --- eval / regenerate argv ------------------------------------------------------------------------

def test_eval_argv_exact(inv):
    ct = inv.container(200)
    assert evaluate.eval_argv(ct, "tiny") == [
        "/root/venv/bin/python", "/root/my code/eval_dflash.py", "--run-dir=/root/runs/tiny",
        "--checkpoint=latest", "--device=cuda:0"]
    assert evaluate.eval_argv(inv.container(201), "r1", checkpoint="step-20", prompts="/d/p q.jsonl",
                              num_prompts=4, max_new_tokens=32, device="cpu") == [
        "/v/bin/python", "/c/eval_dflash.py", "--run-dir=/srv/runs//r1", "--checkpoint=step-20",
        "--prompts=/d/p q.jsonl", "--num-prompts=4", "--max-new-tokens=32", "--device=cpu"]


@pytest.mark.parametrize("checkpoint,needed", [
    ("latest", ("/root/runs/tiny/checkpoints", "d")),
    ("step-20", ("/root/runs/tiny/checkpoints/step-20/config.json", "f")),
    ("init", ("/root/runs/tiny/config.yaml", "f")),  # the script builds the untrained drafter
    ("/x/ckpt", ("/x/ckpt/config.json", "f")),
])
def test_eval_needs_the_run_and_its_checkpoint(inv, checkpoint, needed):
    run_need, checkpoint_need = evaluate.eval_needs(inv.container(200), "tiny", checkpoint, None)
    assert (run_need.path, run_need.test) == ("/root/runs/tiny", "d")
    assert (checkpoint_need.path, checkpoint_need.test) == needed


@pytest.mark.parametrize("kwargs,message", [
    ({"run": "../x"}, "run name"), ({"run": "ok", "checkpoint": "--device=x"}, "--checkpoint"),
    ({"run": "ok", "num_prompts": 0}, "--num-prompts"),
    ({"run": "ok", "max_new_tokens": -1}, "--max-new-tokens"),
])
def test_eval_argv_refuses_bad_values(inv, kwargs, message):
    with pytest.raises(UsageError, match=message):
        evaluate.eval_argv(inv.container(200), **kwargs)


def test_regenerate_argv_defaults_pair_inputs_with_outputs(inv):
    argv, outputs = evaluate.regenerate_argv(inv.container(200))
    assert argv == [
        "/root/venv/bin/python", "/root/my code/regenerate_data.py", "--target=/dev/shm/m",
        "--device=cuda:0", "--dtype=bfloat16",
        "--in=/root/my code/data/train.jsonl", "--out=/root/data/train.jsonl",
        "--in=/root/my code/data/heldout.jsonl", "--out=/root/data/heldout.jsonl"]
    assert outputs == ["/root/data/train.jsonl", "/root/data/heldout.jsonl"]
    argv, outputs = evaluate.regenerate_argv(inv.container(201), sources=["/x/a.jsonl"], out_dir="/o",
                                             limit=5, max_new_tokens=16, batch_size=8)
    assert argv[2:] == ["--target=/m", "--device=cpu", "--dtype=float32", "--max-new-tokens=16",
                        "--limit=5", "--batch-size=8", "--in=/x/a.jsonl", "--out=/o/a.jsonl"]
    _, outputs = evaluate.regenerate_argv(inv.container(201), sources=["/x/sg.parquet", "/x/shards/",
                                                                      "/x/b.jsonl.gz", "/x/c.json"])
    assert outputs == ["/srv/data/sg.jsonl", "/srv/data/shards.jsonl", "/srv/data/b.jsonl",
                       "/srv/data/c.jsonl"]
    with pytest.raises(UsageError, match="different names"):
        evaluate.regenerate_argv(inv.container(201), sources=["a/x.jsonl", "b/x.jsonl"])


def test_regenerate_argv_passes_samples_and_self_prompts_and_refuses_bad_ones(inv):
    argv, _ = evaluate.regenerate_argv(inv.container(201), sources=["/x/a.jsonl"], out_dir="/o",
                                       samples=3, temperature=0.7, seed=4, self_prompts=5000)
    assert argv[5:] == ["--samples=3", "--temperature=0.7", "--seed=4", "--self-prompts=5000",
                        "--in=/x/a.jsonl", "--out=/o/a.jsonl"]
    argv, _ = evaluate.regenerate_argv(inv.container(201), sources=["/o/a.jsonl"], out_dir="/p",
                                       seed=1, self_prompts=9, extend=True)
    assert argv[5:] == ["--seed=1", "--self-prompts=9", "--extend", "--in=/o/a.jsonl",
                        "--out=/p/a.jsonl"]
    argv, _ = evaluate.regenerate_argv(inv.container(201), sources=["/x/a.jsonl"], out_dir="/o",
                                       seed=2, self_prompts=30000, lead_words=3)
    assert argv[5:] == ["--seed=2", "--self-prompts=30000", "--lead-words=3", "--in=/x/a.jsonl",
                        "--out=/o/a.jsonl"]
    for kwargs, message in (({"samples": -1}, "--samples -1: must be >= 0"),
                            ({"self_prompts": -2}, "--self-prompts -2: must be >= 0"),
                            ({"self_prompts": 5, "lead_words": -1}, "--lead-words -1: must be >= 0"),
                            ({"lead_words": 2}, "--lead-words 2: goes with --self-prompts N"),
                            ({"temperature": 0.0}, "--temperature 0.0: must be > 0")):
        with pytest.raises(UsageError, match=message):
            evaluate.regenerate_argv(inv.container(201), **kwargs)


def test_result_lines_are_parsed_and_hidden_from_the_person():
    shown = []
    stream = payload.ShowLines(shown.append)
    stream.write("eval: 2 prompts\nRESULT {\"a\"")
    stream.write(": 1}\nLoading weights: 100%\ndone\n")
    assert shown == ["eval: 2 prompts", "done"]
    assert payload.results_of('x\nRESULT {"a": 1}\nRESULT {"b": 2}\n') == [{"a": 1}, {"b": 2}]
    # A line the script did not mean as a result (a file name with a line break, before the fix in
    # chat_formats.shown) is one error line, not a traceback.
    for junk in ('RESULT {"rows": 1', "RESULT [1]", "RESULT " + "[" * 100_000):
        with pytest.raises(RemoteCommandFailed, match="^unreadable result line from the container: RESULT "):
            payload.results_of(f"read x\n{junk}.jsonl: dflash rows\nRESULT {{}}\n")


def test_a_scripts_own_error_line_is_left_to_the_tasks_error():
    shown = []
    own = payload.script_error(["/venv/bin/python", "/root/dflash/eval_dflash.py", "--run-dir=/r"])
    assert own == "eval_dflash: error: "
    stream = payload.ShowLines(shown.append, (own,))
    stream.write("a warning\neval_dflash: error: no prompts\n")
    assert shown == ["a warning"]


def test_describe_names_every_number():
    record = {"checkpoint": "/r/checkpoints/step-9", "target": "/m", "device": "cpu", "dtype": "float32",
              "prompts": 4, "max_new_tokens": 32, "new_tokens": 100, "lossless": True,
              "mismatched_prompts": [], "acceptance_length": 2.5, "block_size": 8,
              "tokens_per_target_forward": 2.2, "target_forwards": {"spec": 45, "plain": 100},
              "speedup": 1.3, "plain_tokens_per_s": 100.0, "spec_tokens_per_s": 130.0,
              "acceptance_histogram": [10, 0, 5]}
    text = evaluate.describe(record)
    for part in ("lossless            yes", "acceptance length   2.50", "(block size 8)", "2.20",
                 "45 target forwards vs 100 plain", "1.30x", "1:10 3:5"):
        assert part in text
    assert "at the limit" not in text  # a record without per_prompt (an older eval_dflash.py)
    # per_prompt: [new tokens, steps]; the first token of each answer comes from the prefill
    long = dict(record, per_prompt=[[32, 8], [32, 11], [11, 5], [5, 4], [1, 0]])
    assert ("at the limit        2 of 5 answers reached 32 new tokens (acceptance length 3.26 on "
            "those, 1.56 on the rest)") in evaluate.describe(long)
    # no answer at the limit, or every one: a split with an empty side says nothing, the count alone
    short = evaluate.describe(dict(record, per_prompt=[[11, 5], [5, 4]]))
    assert "at the limit        0 of 2 answers reached 32 new tokens\n" in short + "\n"
    assert "on those" not in short and "on the rest" not in short
    assert "on the rest" not in evaluate.describe(dict(record, per_prompt=[[32, 8], [40, 9]]))
    for junk in ([[32, 8], [32]], [[32, "8"]], [[-1, 0]], "32,8", [[True, 1]]):
        assert "at the limit" not in evaluate.describe(dict(record, per_prompt=junk))
    broken = dict(record, lossless=False, mismatched_prompts=[1, 3], first_divergence=[0, 17])
    assert "lossless            NO: prompts [1, 3] differ from token [0, 17] on" in evaluate.describe(broken)


# --- fetch -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["step-x", "../step-1", "latest; rm", ""])
def test_fetch_checkpoint_names_are_checked(name):
    with pytest.raises(UsageError):
        fetch.validate_checkpoint(name)


def test_regeneration_summary_warns_when_answers_never_end():
    fine = {"out": "/root/data/train.jsonl", "rows": 10, "turns": 12, "changed": 9, "truncated": 1}
    assert evaluate.describe_regeneration(fine) == (
        "/root/data/train.jsonl: 10 rows, 9 of 12 answers changed, 1 cut at the token limit")
    runaway = dict(fine, truncated=12)
    assert "warning: most answers never ended" in evaluate.describe_regeneration(runaway)


# --- the last evaluation in `invoke status` ------------------------------------------------------

STATUS_WITH_EVAL = """\
now 1795954010
name t1
exists 1
alive 0
pid 82
started 1795953931
ended 1795953966
exit_code 0
metric {"kind": "train", "step": 30, "loss": 4.7, "acceptance_length": 1.13, "tokens_per_s": 4905.8, "lr": 0.004}
evaljson {"kind": "dflash_eval", "time": 1795954000.5, "step": 30, "prompts": 4, "lossless": true, "mismatched_prompts": [], "acceptance_length": 6.2, "acceptance_histogram": [1, 0, 0, 0, 0, 0, 2, 5], "tokens_per_target_forward": 4.1, "speedup": 1.7}
end
"""  # noqa: E501


def test_status_shows_the_last_dflash_evaluation():
    from rich.console import Console

    from dflash_ops import status

    st = status.parse_status(status_answer(STATUS_WITH_EVAL))
    assert st.last_eval == {"step": 30, "acceptance_length": 6.2, "tokens_per_target_forward": 4.1,
                            "speedup": 1.7, "lossless": True, "prompts": 4, "time": 1795954000.5}
    console = Console(width=160, record=True)
    status.render(st, "pve1/200", console=console)
    row = next(line for line in console.export_text().splitlines() if "last dflash eval" in line)
    assert ("acceptance 6.20, 4.10 tokens/target forward, speedup 1.70x, lossless (step 30, 4 prompts)"
            in row)
    torn = status.parse_status(status_answer(STATUS_WITH_EVAL.replace('"speedup": 1.7}', '"speedup": 1')))
    assert torn.last_eval is None and torn.step == 30  # eval.json being rewritten: no eval row


def test_status_script_prints_eval_json_on_one_line(tmp_path):
    from dflash_ops import status

    run = tmp_path / "runs" / "t1"
    run.mkdir(parents=True)
    (run / "eval.json").write_text(json.dumps({"step": 3, "acceptance_length": 2.5, "lossless": True},
                                              indent=1))
    out = run_verb("status", {"runs": str(tmp_path / "runs"), "name": "t1"})
    assert status.parse_status(out).last_eval["acceptance_length"] == 2.5

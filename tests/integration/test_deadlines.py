"""Every task's work in the container has a deadline: a payload script that never ends (the container's
venv python sleeps), a command that never ends: each is ended at its --timeout, in the container too
(its process group), and the operator reads one line and exit 13. Before, each of them waited for ever.
A FIFO planted in the target store (which blocked the shell `stage` of old) is refused at once by the
stage verb, which opens nothing but regular files.

No deploy: the container's venv is a shell script that sleeps, made from inside container 200.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from training_runs import CT, REPO, Deployed
from waiting import wait_for

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration
ROOT = "/root/hang"  # everything of this module in the container
TRACEBACK = "Traceback (most recent call last)"


@pytest.fixture(scope="module")
def hung(sandbox, tmp_path_factory):
    """An inventory whose container 200 has a venv python that sleeps `sleep <mark>` (a number no
    other process uses), the paths the tasks check before they start, and a target store whose
    weights became a FIFO after their checksum was recorded."""
    box = Deployed(sandbox)
    mark = str(10**7 + uuid.uuid4().int % 10**7)
    box.sh('r=$1; rm -rf "$r" && mkdir -p "$r/venv/bin" "$r/code/data" "$r/code/configs" '
           '"$r/runs/anyrun/checkpoints" "$r/model" "$r/store" && '
           'printf "#!/bin/sh\\nexec sleep %s\\n" "$2" > "$r/venv/bin/python" && '
           'chmod +x "$r/venv/bin/python" && touch "$r/code/warmup_compile.py" "$r/code/data/train.jsonl" '
           '"$r/code/data/heldout.jsonl" "$r/code/configs/tiny-cpu.yaml" && '
           'echo "{}" > "$r/model/config.json" && '
           'echo weights > "$r/store/w" && (cd "$r/store" && sha256sum ./w > "$r/store.sha256") && '
           'rm "$r/store/w" && mkfifo "$r/store/w"', ROOT, mark)
    inv = yaml.safe_load(Path(box.inventory).read_text())
    inv["containers"][int(CT)]["paths"].update(venv=f"{ROOT}/venv", code=f"{ROOT}/code", runs=f"{ROOT}/runs",
                                               model=f"{ROOT}/model", model_store=f"{ROOT}/store")
    path = tmp_path_factory.mktemp("hung") / "hung.yaml"
    path.write_text(yaml.safe_dump(inv))
    yield box, str(path), mark
    box.sh('rm -rf "$1"', ROOT)


def ours(box, *needles):
    """The container's processes of the task: its command, or the tool's session wrapper around one."""
    needles = (*needles, "dflash-session", "dflash-watch")
    return [p for p in box.processes() if any(n in p for n in needles)]


@pytest.mark.parametrize("task, what", [
    (["plan"], "plan"),
    (["eval", "--run", "anyrun"], "evaluation"),
    (["regenerate", "--limit", "1"], "regeneration"),
    (["warmup"], "the warm-up"),
    (["exec"], "the command"),  # `-- sleep <mark>`
])
def test_a_task_that_never_ends_is_ended_at_its_deadline_with_one_line(hung, task, what):
    box, inventory, mark = hung
    command = ["--", "sleep", mark] if task == ["exec"] else []
    argv = [sys.executable, "-m", "invoke", *task, "--timeout", "2", "--inventory", inventory, "--ct", CT,
            *command]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == ExitStatus.TIMED_OUT, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert TRACEBACK not in r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: pve1/200: {what} ran past its deadline of 2 s and was ended in the container "
                      "(its process group with it); give a longer --timeout"], r.stderr
    # Its process group in the container is gone with the session (SIGTERM, SIGKILL 5 s later).
    wait_for(f"nothing of `{task[0]}` left in the container",
             lambda: not ours(box, f"sleep {mark}"), timeout=60, every=0.5)


def test_a_fifo_in_the_target_store_is_refused_at_once_and_nothing_is_replaced(hung):
    box, inventory, _ = hung
    argv = [sys.executable, "-m", "invoke", "stage", "--timeout", "60", "--inventory", inventory, "--ct", CT]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == ExitStatus.CHECKSUM_MISMATCH, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert TRACEBACK not in r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "./w: FAILED open or read" in errors[0], r.stderr
    assert "nothing was replaced" in errors[0]
    assert box.container("cat", f"{ROOT}/model/config.json").stdout == "{}\n"  # the old copy stays
    assert not [p for p in box.processes() if "dflash-session" in p]

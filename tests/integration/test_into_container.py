"""Into the container: `invoke exec -- CMD...` and `invoke shell` (the run environment: venv first on
PATH, the inventory's env, paths.code as cwd; exit codes kept; bad input one line), and `invoke stage`
(the target back into /dev/shm from its persistent copy, checked against the recorded sha256)."""

import os
import pty
import select
import subprocess
from pathlib import Path

import pytest
import yaml

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
INVOKE = str(REPO / ".venv/bin/invoke")


@pytest.fixture(scope="module")
def box(sandbox_factory):
    sb = sandbox_factory(containers=(200,), stopped=(201,))
    # paths.code, which deploy would make: the commands run there
    subprocess.run([str(sb.pct), "exec", "200", "--", "mkdir", "-p", "/root/dflash"], check=True, timeout=60)
    return sb


def invoke(box, *args, **kwargs):
    return subprocess.run([INVOKE, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "INVOKE_DFLASH_INVENTORY": str(box.inventory)}, **kwargs)


def test_exec_runs_with_the_run_environment_and_keeps_arguments_and_the_exit_code(box):
    script = 'printf "%s|%s|%s|%s|%s" "$PWD" "$VIRTUAL_ENV" "${PATH%%:*}" "$CUDA_MODULE_LOADING" "$1"; ' \
             'echo to-err >&2; exit 7'
    r = invoke(box, "exec", "--ct", "200", "--", "sh", "-c", script, "sh", "a  b $(id)")
    assert r.returncode == 7, r.stderr
    assert r.stdout == "/root/dflash|/root/venv|/root/venv/bin|LAZY|a  b $(id)"
    assert r.stderr == "to-err\n"


def test_exec_shows_control_characters_visibly(box):
    r = invoke(box, "exec", "--ct", "200", "--", "printf", "\\033]0;title\\007ok")
    assert r.returncode == ExitStatus.OK and r.stdout == "^[]0;title^Gok"


@pytest.mark.parametrize("args, code, said", [
    (["exec", "--ct", "200"], ExitStatus.USAGE, "error: exec: give the command after --"),
    (["exec", "--ct", "200", "--"], ExitStatus.USAGE, "error: exec: the command after -- is empty"),
    (["shell", "--ct", "200"], ExitStatus.USAGE, "error: shell needs a terminal on stdin"),
])
def test_bad_input_is_one_line(box, args, code, said):
    r = invoke(box, *args, stdin=subprocess.DEVNULL)
    assert (r.returncode, r.stderr.count("\n")) == (code, 1), r.stderr
    assert r.stderr.startswith(said) and "Traceback" not in r.stderr


def test_exec_in_a_stopped_container_says_so(box):
    r = invoke(box, "exec", "--ct", "201", "--", "true")
    assert r.returncode == ExitStatus.CONTAINER and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1].startswith("error: container 201 on host pve1 is stopped")


def test_shell_is_a_pty_with_the_run_environment_and_its_exit_code(box):
    pid, controller = pty.fork()  # the child's controlling terminal, as in a terminal window
    if pid == 0:
        os.chdir(REPO)
        os.execve(INVOKE, [INVOKE, "shell", "--ct", "200"],
                  {**os.environ, "INVOKE_DFLASH_INVENTORY": str(box.inventory)})
    seen, typed = b"", False
    while True:  # until the child has gone (EIO or end of file on the terminal)
        ready, _, _ = select.select([controller], [], [], 120)
        assert ready, seen
        try:
            chunk = os.read(controller, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
        if not typed and seen.rstrip().endswith((b"#", b"$")):  # the shell's prompt: it reads now
            os.write(controller, b'[ -t 0 ] && echo "tty:$VIRTUAL_ENV:$PWD"; exit 3\n')
            typed = True
    os.close(controller)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3, seen
    assert b"tty:/root/venv:/root/dflash" in seen


STORE, MODEL = "/root/models/target", "/dev/shm/staged-target"


@pytest.fixture(scope="module")
def staging(box, tmp_path_factory):
    """An inventory whose container 200 has paths.model_store, and a store with two files in it."""
    data = yaml.safe_load(Path(box.inventory).read_text())
    data["containers"][200]["paths"].update({"model": MODEL, "model_store": STORE})
    path = tmp_path_factory.mktemp("stage") / "inventory.yaml"
    path.write_text(yaml.safe_dump(data))
    in_ct(box, f"mkdir -p {STORE}/sub && head -c 3000000 /dev/urandom > {STORE}/model.safetensors && "
               f"echo '{{\"model_type\": \"qwen3\"}}' > {STORE}/config.json && echo b > {STORE}/sub/b")
    return str(path)


def in_ct(box, script):
    return subprocess.run([str(box.pct), "exec", "200", "--", "sh", "-c", script], capture_output=True,
                          text=True, timeout=60, check=True).stdout


def stage(staging, *args):
    return subprocess.run([INVOKE, "stage", "--inventory", staging, "--ct", "200", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_stage_copies_the_store_checked_against_the_record_and_reports_bytes_and_time(box, staging):
    r = stage(staging)
    assert r.returncode == ExitStatus.REMOTE_FAILED and r.stderr.count("\n") == 1, r.stderr
    assert f"no recorded checksum {STORE}.sha256" in r.stderr and "invoke stage --record" in r.stderr
    r = stage(staging, "--record")
    assert r.returncode == ExitStatus.OK, r.stderr
    assert f"recorded the sha256 of every file of {STORE}" in r.stdout, r.stderr
    r = stage(staging)
    assert r.returncode == ExitStatus.OK, r.stderr
    assert f"staged {STORE} -> {MODEL} on pve1/200:" in r.stdout
    assert " s (" in r.stdout and "bytes" in r.stdout
    listed = in_ct(box, f"cd {MODEL} && find . -type f | sort && sha256sum -c --quiet {STORE}.sha256 && "
                        "echo same")
    assert listed == "./.dflash-staged\n./config.json\n./model.safetensors\n./sub/b\nsame\n"
    again = stage(staging)
    assert again.returncode == ExitStatus.OK and "already staged" in again.stdout, again.stderr


def test_a_store_that_no_longer_matches_its_record_replaces_nothing(box, staging):
    stage(staging, "--record")
    in_ct(box, f"rm -rf {MODEL}; echo changed > {STORE}/sub/b")  # a restart, and a damaged store
    try:
        r = stage(staging)
        assert r.returncode == ExitStatus.CHECKSUM_MISMATCH and r.stderr.count("\n") == 1, r.stderr
        assert f"does not match {STORE}.sha256" in r.stderr and "sub/b" in r.stderr
        assert in_ct(box, f"ls -d {MODEL}* /dev/shm/*.dflash-stage.* 2>/dev/null; true") == ""  # nothing left
    finally:
        in_ct(box, f"echo b > {STORE}/sub/b")


def test_a_pinned_run_is_never_pruned(box):
    in_ct(box, "mkdir -p /root/runs/best/checkpoints && sleep 1.1 && mkdir -p /root/runs/later/checkpoints")
    r = invoke(box, "runs", "--ct", "200", "--pin", "best")
    assert r.returncode == ExitStatus.OK and "(pinned)" in r.stdout, r.stderr
    dry = invoke(box, "prune", "--ct", "200", "--keep", "1")
    assert "kept       pinned run best (never touched;" in dry.stdout and "run        " not in dry.stdout
    done = invoke(box, "prune", "--ct", "200", "--keep", "1", "--yes")
    assert done.returncode == ExitStatus.OK, done.stdout
    assert in_ct(box, "ls /root/runs").split() == ["best", "later"], done.stdout
    assert invoke(box, "runs", "--ct", "200", "--unpin", "best").returncode == ExitStatus.OK
    assert "run" in invoke(box, "prune", "--ct", "200", "--keep", "1").stdout.split("\n", 2)[1]
    missing = invoke(box, "runs", "--ct", "200", "--pin", "nosuch")
    assert missing.returncode == ExitStatus.RUN_STATE
    assert missing.stderr.count("\n") == 1 and "no run 'nosuch'" in missing.stderr


def test_sandbox_down_purge_leaves_nothing_on_disk(sandbox_factory):
    sb = sandbox_factory(containers=(200,))
    r = subprocess.run([INVOKE, "sandbox.down", "--purge"], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "DFLASH_SANDBOX_STATE": str(sb.state_dir)})
    assert r.returncode == ExitStatus.OK, r.stderr
    assert f"removed {Path(sb.state_dir).resolve()}" in r.stdout and not Path(sb.state_dir).exists()

"""On-call against the embedded host: `status --check` per state, `status --prometheus` of a finished run,
and `invoke watch` posting to a real HTTP server on 127.0.0.1 through stall (SIGSTOP), resume
(SIGCONT) and crash (SIGKILL)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families
from signals import sigint_default
from training_runs import LONG, REPO, deployed  # noqa: F401 (deployed: the module's container)
from webhook_receiver import SECRET_URL_PARTS, Receiver

from dflash_ops.errors import ExitStatus
from dflash_ops.oncall import monitoring
from dflash_ops.remote.readings import human_bytes

pytestmark = pytest.mark.integration


def check(d, *args, run="victim", **kw):
    r = d.invoke("status", "--check", "--run", run, *args, check=False, **kw)
    # -s shows it
    print(f"status --check --run {run} {' '.join(args)}: exit {r.returncode}: {r.stdout.strip()}")
    assert r.stderr == "" and len(r.stdout.splitlines()) == 1, r.stdout + r.stderr
    return r.returncode, r.stdout.strip()


def watch_argv(d, run, *extra):
    return d.invoke_argv("watch", "--run", run, "--every", "1", *extra)


def pgid(d, run):
    return d.run_file(run, "pgid").strip()


def test_check_and_watch_a_run_through_stall_resume_and_crash(deployed):
    d, hook = deployed, Receiver()
    d.train("victim", *LONG)
    d.wait_for("the first step", lambda: d.status("victim")["step"], every=2.0)
    code, line = check(d)
    assert code == monitoring.OK and line.startswith("OK - pve1/200: run victim running, step "), line
    assert " | step=" in line and " tok_s=" in line and " free_shm=" in line

    watch = subprocess.Popen(watch_argv(d, "victim", "--stall-after", "6", "--hang-after", "100000"),
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, DFLASH_WEBHOOK_URL=hook.url))
    try:
        d.wait_for("the watch's first event", lambda: hook.kinds())
        argv = open(f"/proc/{watch.pid}/cmdline", "rb").read().decode()  # what every local user can read
        assert not [part for part in SECRET_URL_PARTS if part in argv], argv
        d.container("kill", "-STOP", "--", f"-{pgid(d, 'victim')}")  # the whole run: wrapper and trainer
        d.wait_for("the stalled event", lambda: "stalled" in hook.kinds(), every=1.0)
        code, line = check(d, "--stall-after", "2")
        assert code == monitoring.WARNING
        assert line.startswith("WARNING - pve1/200: run victim stalled: no new log line or metric"), line
        code, line = check(d, "--stall-after", "2", "--hang-after", "3")
        assert code == monitoring.CRITICAL and line.startswith("CRITICAL - pve1/200: run victim hung:"), line

        d.container("kill", "-CONT", "--", f"-{pgid(d, 'victim')}")
        d.wait_for("the recovered event", lambda: "recovered" in hook.kinds(), every=1.0)
        d.container("kill", "-KILL", d.run_file("victim", "pid").strip())
        out, err = watch.communicate(timeout=240)
    finally:
        watch.kill()
    print(f"watch: exit {watch.returncode}\n{out}{err}"
          + "".join(f"received: {json.dumps(b)}\n" for b in hook.bodies))
    assert watch.returncode == ExitStatus.RUN_STATE, out + err  # the run crashed
    kinds = hook.kinds()
    assert kinds[0] == "watching" and kinds[-1] == "crashed", kinds
    assert kinds.index("stalled") < kinds.index("recovered"), kinds
    crashed = hook.bodies[-1]
    assert crashed["text"].startswith("run victim on pve1/200 crashed: killed by signal 9 (SIGKILL); "
                                      "read docs/runbooks/alerting.md"), crashed
    assert crashed["event"]["runbook"] == "docs/runbooks/alerting.md" and crashed["event"]["run"] == "victim"
    assert [line.split(" ", 2)[1] for line in out.splitlines()] == [k + ":" for k in kinds]
    assert not any(s in out + err for s in SECRET_URL_PARTS)
    assert "error: run victim on pve1/200 crashed" in err
    code, line = check(d)
    assert code == monitoring.CRITICAL
    assert line.startswith("CRITICAL - pve1/200: run victim crashed: killed by signal 9 (SIGKILL)")


def test_finished_run_is_ok_and_its_prometheus_text_parses(deployed, tmp_path):
    d = deployed
    d.train("tiny", "--max-steps", "3")
    d.wait_for_file("tiny", "exit_code")
    code, line = check(d, run="tiny")
    assert code == monitoring.OK, line
    assert line.startswith("OK - pve1/200: run tiny finished (exit 0), step 3"), line
    code, line = check(d, "--min-free", "1000T", run="tiny")
    assert (code == monitoring.WARNING and "low space: " in line
            and "free on the runs dir (threshold 1024000.0 GiB)" in line), line

    prom = tmp_path / "dflash.prom"
    r = d.invoke("status", "--run", "tiny", "--prometheus", str(prom))
    assert r.stdout.strip() == f"wrote {prom}"
    print(prom.read_text())
    families = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
    value = {(s.name, s.labels.get("state") or s.labels.get("slot") or s.labels.get("fs")): s.value
             for f in families.values() for s in f.samples}
    train = [json.loads(x) for x in d.run_file("tiny", "metrics.jsonl").splitlines()]
    last = [m for m in train if m.get("kind", "train") == "train"][-1]
    assert value[("dflash_up", None)] == 1 and value[("dflash_run_state", "finished")] == 1
    assert value[("dflash_run_step", None)] == 3 and value[("dflash_run_checkpoint_step", None)] == 3
    assert value[("dflash_run_loss", None)] == pytest.approx(last["loss"])
    assert value[("dflash_run_acceptance_length", None)] == pytest.approx(last["acceptance_length"])
    assert value[("dflash_run_slot_accuracy", "1")] == pytest.approx(last["slot_accuracy"][0])
    assert value[("dflash_run_tokens_per_second", None)] == pytest.approx(last["tokens_per_s"])
    assert (value[("dflash_filesystem_free_bytes", "runs")] > 0
            and value[("dflash_filesystem_free_bytes", "shm")] > 0)
    assert all(f.type == "gauge" for f in families.values())
    assert {s.labels["run"] for s in families["dflash_run_step"].samples} == {"tiny"}


def test_host_down_host_key_refused_and_bad_flags(deployed, tmp_path):
    d = deployed
    inventory = open(d.inventory).read()
    down = tmp_path / "down.yaml"
    down.write_text(inventory.replace(f"port: {d.sandbox.port}", "port: 9"))
    code, line = check(d, run="tiny", inventory=str(down))
    assert code == monitoring.UNKNOWN, line
    assert line.startswith("UNKNOWN - pve1/200: cannot reach") and "127.0.0.1:9" in line, line
    (tmp_path / "known_hosts").write_text("")
    refused = tmp_path / "refused.yaml"
    refused.write_text(inventory.replace(str(d.sandbox.known_hosts), str(tmp_path / "known_hosts")))
    code, line = check(d, run="tiny", inventory=str(refused))
    assert code == monitoring.UNKNOWN and line.startswith("UNKNOWN - pve1/200: ") and "host key" in line, line
    r = d.invoke("status", "--prometheus", str(tmp_path / "no-such-dir" / "dflash.prom"), check=False)
    assert (r.returncode, r.stdout) == (ExitStatus.USAGE, "") and r.stderr.strip() == (
        f"error: --prometheus {tmp_path}/no-such-dir/dflash.prom: cannot write it: No such file or directory")
    code, line = check(d, "--min-free", "banana", run="tiny")
    assert code == monitoring.UNKNOWN
    assert line == "UNKNOWN - --min-free 'banana': expected a size such as 10G, 512M or a number of bytes"
    for argv, said in ((("prune", "--keep", "0"),
                        "--keep 0: keep at least 1 run (the newest); the alive run is always kept"),
                       (("prune", "--keep", "2", "--older-than", "banana"),
                        "--older-than 'banana': expected an age such as 7d, 12h, 30m or 2w")):
        r = d.invoke(*argv, check=False)
        print(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
        assert (r.returncode, r.stdout, r.stderr) == (ExitStatus.USAGE, "", f"error: {said}\n")


def test_unreachable_webhook_is_retried_reported_and_the_watch_goes_on(deployed, tmp_path):
    d = deployed
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen = tmp_path / "events.jsonl"
    d.train("long", *LONG)
    hook_file = tmp_path / "hook"
    hook_file.write_text(f"http://127.0.0.1:{port}/hooks/tok3n\n")
    hook_file.chmod(0o600)
    watch = subprocess.Popen(watch_argv(d, "long", "--webhook-file", str(hook_file),
                                        "--notify-cmd", f"{sys.executable} -c 'import sys; "
                                        f"open(sys.argv[1], \"a\").write(sys.stdin.read())' {seen}"),
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        d.wait_for("the watching event", lambda: seen.exists() and seen.read_text())
        d.invoke("stop", "--run", "long", "--grace", "0")
        out, err = watch.communicate(timeout=240)
    finally:
        watch.kill()
    print(f"watch: exit {watch.returncode}\n{out}{err}")
    assert watch.returncode == ExitStatus.OK, out + err
    assert [json.loads(x)["event"] for x in seen.read_text().splitlines()] == ["watching", "stopped"]
    assert out.splitlines()[-1].split(" ", 2)[1] == "stopped:"
    shown = f"webhook http://127.0.0.1:{port}/***"
    reached = f"cannot reach http://127.0.0.1:{port}/***: [Errno 111] Connection refused"
    assert f"{shown}: attempt 1 for event 'watching' failed ({reached}); retrying in 1 s" in err, err
    assert f"{shown}: event 'stopped' not delivered after 5 attempt(s)" in err, err
    assert "tok3n" not in out + err


# $1 a finished run, $2 its copy, $3 days: the copy looks as if it ran $3 days ago.
COPY_AS_OLD = '''cp -a "$1" "$2" && t=$(( $(date +%s) - $3 * 86400 )) && echo "$t" > "$2/started" &&
echo $((t + 60)) > "$2/ended" && find "$2" -exec touch -h -d "@$((t + 60))" {} +'''


def counted(d, *args):
    """`invoke ARGS` with DFLASH_OPS_STATS=1: (result, its ssh stats lines)."""
    r = subprocess.run(d.invoke_argv(*args), cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "DFLASH_OPS_STATS": "1"})
    assert r.returncode == ExitStatus.OK, r.stdout + r.stderr
    return r, [line for line in r.stderr.splitlines() if line.startswith("ssh stats:")]


def test_runs_and_prune_on_five_runs_leave_the_alive_run_alone(deployed):
    d = deployed
    d.stop_any()
    d.container("rm", "-rf", "/root/runs")
    d.train("r-new", "--max-steps", "3")
    d.wait_for_file("r-new", "exit_code")
    for name, days in (("r-week", 8), ("r-fortnight", 15), ("r-month", 31)):
        d.container("sh", "-c", COPY_AS_OLD, "sh", "/root/runs/r-new", f"/root/runs/{name}", str(days))
    d.container("cp", "-a", "/root/runs/r-new/checkpoints/step-2", "/root/runs/r-new/checkpoints/step-1")
    d.train("live", *LONG)

    r, stats = counted(d, "runs", "--json")
    assert stats == ["ssh stats: pve1: 1 connection(s), 1 round trip(s)"]
    listed = json.loads(r.stdout)
    assert listed["alive"] == "live"
    assert [(x["name"], x["state"]) for x in listed["runs"]] == [
        ("live", "running"), ("r-new", "finished"), ("r-week", "finished"), ("r-fortnight", "finished"),
        ("r-month", "finished")]
    new = listed["runs"][1]
    assert (new["step"], new["latest_checkpoint"]) == (3, "step-3") and new["bytes"] > 0
    table = d.invoke("runs").stdout
    print(r.stdout + table)
    assert "pve1/200: 5 runs" in table and "r-fortnight" in table and "running (alive)" in table

    dry = d.invoke("prune", "--keep", "2", "--older-than", "10d")
    plan = [line.split() for line in dry.stdout.splitlines() if line.startswith("  ")]
    assert [(w[0], w[3]) for w in plan if w[0] != "kept"] == [
        ("checkpoint", "r-new/checkpoints/step-1"), ("run", "r-fortnight"), ("run", "r-month")], dry.stdout
    assert "kept       alive run live (never touched)" in dry.stdout
    print(dry.stdout)
    would = int(re.search(r"would free .* \((\d+) bytes\); run again with --yes", dry.stdout).group(1))
    assert d.container("test", "-d", "/root/runs/r-month", check=False).returncode == 0  # nothing removed yet

    step_before = d.status("live")["step"] or 0
    done, stats = counted(d, "prune", "--keep", "2", "--older-than", "10d", "--yes")
    assert stats == ["ssh stats: pve1: 1 connection(s), 1 round trip(s)"]
    print(done.stdout)
    assert f"freed {human_bytes(would)} ({would} bytes)" in done.stdout, done.stdout
    left = d.container("ls", "/root/runs").stdout.split()
    assert left == ["live", "r-new", "r-week"]
    assert d.container("ls", "/root/runs/r-new/checkpoints").stdout.split() == ["latest", "step-2", "step-3"]
    d.wait_for("the live run to go on", lambda: (s := d.status("live"))["state"] == "running" and
               (s["step"] or 0) > step_before, every=2.0)
    assert "nothing to prune" in d.invoke("prune", "--keep", "2", "--older-than", "10d", "--yes").stdout
    d.invoke("stop", "--run", "live", "--grace", "0")


def test_ctrl_c_ends_the_watch_cleanly_and_the_run_goes_on(deployed, tmp_path):
    d = deployed
    seen = tmp_path / "events.jsonl"
    d.train("watched", *LONG)
    watch = subprocess.Popen(watch_argv(d, "watched", "--notify-cmd", f"sh -c 'cat >> {seen}'"), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=sigint_default)
    try:
        d.wait_for("the watching event", lambda: seen.exists() and seen.read_text())
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=60)
    finally:
        watch.kill()
    assert watch.returncode == ExitStatus.OK and err == "", out + err
    assert out.splitlines()[-1] == "stopped watching; the run goes on"
    assert json.loads(seen.read_text().splitlines()[0])["event"] == "watching"  # `sh -c` given by the user
    assert d.status("watched")["state"] == "running"
    d.invoke("stop", "--run", "watched", "--grace", "0")


def test_a_lost_host_is_an_event_and_the_watch_goes_on_until_the_run_ends(deployed, tmp_path):
    from dflash_ops import sandbox as sandbox_mod

    d = deployed
    seen = tmp_path / "events.jsonl"

    def kinds():
        return [json.loads(x)["event"] for x in seen.read_text().splitlines()] if seen.exists() else []

    d.train("far", *LONG)
    watch = subprocess.Popen(watch_argv(d, "far", "--notify-cmd", f"sh -c 'cat >> {seen}'"), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        d.wait_for("the watching event", kinds)
        listener = sandbox_mod.status(d.sandbox.state_dir).hosts[0].sshd_pid
        for pid in sandbox_mod._descendants(listener) + [listener]:  # the host's sshd and its sessions
            os.kill(pid, signal.SIGKILL)
        d.wait_for("the unreachable event", lambda: "unreachable" in kinds())
        sandbox_mod.up(d.sandbox.state_dir, inventory_path=d.inventory, containers=(200,), stopped=(201,))
        d.wait_for("the reachable event", lambda: "reachable" in kinds())
        d.invoke("stop", "--run", "far", "--grace", "0")
        out, err = watch.communicate(timeout=120)
    finally:
        watch.kill()
    assert watch.returncode == ExitStatus.OK, out + err
    assert kinds() == ["watching", "unreachable", "reachable", "stopped"], out
    assert "cannot read the run's facts: " in out and "pve1" in out

"""Wall time of each dflash-ops task on the embedded host, as a ratio to a bare OpenSSH
`ssh host pct exec 200 -- true` measured in the same run; and the bytes a deploy sends.

    .venv/bin/python bench/bench_tasks.py [--repeat 5] [--state DIR]

Run from the repository root, as root (the embedded host needs it). It brings up its own sandbox
(or reuses --state DIR, which then keeps the container's venv for the next run), runs the real CLI
(`.venv/bin/invoke ... --inventory <sandbox> --ct 200`) from a frozen copy of this checkout, deploys
once (venv, tiny target), trains a 2-step run so that status and logs have something to read, then
times each task --repeat times and prints medians, with the load average around the timed runs.
The "floor" row is what every task pays before its own work (interpreter, Invoke and the transport
imported, the baseline's command as one round trip): no task can be faster. Tasks run as a user runs
them, with connection sharing on (the inventory's default control_persist: a master left by the first
task carries the next ones' commands, dflash_ops.mux); the rows marked "no sharing" run with
DFLASH_CONTROL_PERSIST=0, each task on a connection of its own. Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_ops import deploy, mux, sandbox  # noqa: E402
from dflash_ops.inventory import load_inventory  # noqa: E402

INVOKE = str(REPO / ".venv" / "bin" / "invoke")
CT = "200"


class Bench:
    def __init__(self, box: sandbox.Sandbox, checkout: Path, control: Path):
        self.box, self.checkout = box, checkout
        # The bench's masters live in a control dir of its own: none of the user's is used or left.
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(control), mux.ENV: "60"}
        os.environ["XDG_RUNTIME_DIR"] = str(control)  # for socket_path and stop below
        self.master = mux.socket_path(load_inventory(box.inventory).container(int(CT)).host)

    def sharing(self, on: bool) -> None:
        """Sharing on: start a master (one task) and wait until it answers. Off: stop it."""
        if on:
            self.env[mux.ENV] = "60"
            self.invoke("status", "--json")
            deadline = time.monotonic() + 30
            while not mux.answers(self.master):
                if time.monotonic() > deadline:
                    raise SystemExit(f"bench: no master answered at {self.master} within 30 s")
                time.sleep(0.05)
        else:
            self.env[mux.ENV] = "0"
            mux.stop(self.master)

    def invoke(self, *args: str, check: bool = True) -> tuple[float, str]:
        argv = [INVOKE, *args, "--inventory", str(self.box.inventory), "--ct", CT]
        start = time.perf_counter()
        r = subprocess.run(argv, cwd=self.checkout, capture_output=True, text=True, timeout=900, env=self.env)
        elapsed = time.perf_counter() - start
        if check and r.returncode != 0:
            raise SystemExit(f"bench: invoke {' '.join(args)} failed ({r.returncode}): "
                             f"{r.stderr.strip()[-500:]}")
        return elapsed, r.stdout

    def bare_ssh(self) -> float:
        argv = self.box.ssh_argv(f"{self.box.pct} exec {CT} -- true")
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, timeout=60)
        return time.perf_counter() - start

    def floor(self) -> float:
        """What any task pays before its own work: a fresh interpreter importing Invoke (the entry
        point) and the CLI's plumbing (dflash_ops.cli: inventory, transport, and what it does at
        exit), the inventory read, and the baseline's command as one round trip: through the master
        with sharing on, else on a connection of its own (paramiko and fabric imported, connect, auth)."""
        code = ("import sys, invoke, dflash_ops.cli; from dflash_ops.inventory import load_inventory; "
                "from dflash_ops.transport import HostSession; "
                "host = load_inventory(sys.argv[1]).container(sys.argv[2]).host; "
                "HostSession(host).run(sys.argv[3])")
        argv = [sys.executable, "-c", code, str(self.box.inventory), CT, f"{self.box.pct} exec {CT} -- true"]
        start = time.perf_counter()
        subprocess.run(argv, cwd=self.checkout, check=True, capture_output=True, timeout=60, env=self.env)
        return time.perf_counter() - start


def wait_finished(b: Bench, run: str, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = json.loads(b.invoke("status", "--run", run, "--json")[1]).get("state", "?")
        if state != "running":
            return state
        time.sleep(2)
    raise SystemExit(f"bench: run {run} still running after {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions per task (median shown)")
    parser.add_argument("--state", help="sandbox state dir to create or reuse (default: a temporary one)")
    args = parser.parse_args()

    state = args.state or tempfile.mkdtemp(prefix="dflash-bench-")
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-checkout-"))
    control = work / "control"
    control.mkdir(mode=0o700)
    box = sandbox.up(state, containers=(int(CT),), inventory_path=f"{state}/sandbox.yaml")
    b = Bench(box, deploy.snapshot_checkout(work / "checkout"), control)
    try:
        first, out = b.invoke("deploy")
        print(f"setup: first deploy {first:.1f} s ({deploy.parse_describe(out)})", flush=True)
        # A reused --state keeps the finished run; launching it again is refused (it reached max_steps).
        if json.loads(b.invoke("status", "--run", "bench", "--json")[1]).get("state") != "finished":
            b.invoke("train", "--run", "bench", "--max-steps", "2", "--set", "data.heldout=null")
        print(f"setup: training run 'bench' ended: {wait_finished(b, 'bench')}", flush=True)

        edited = b.checkout / "remote_scripts" / "train_config.py"
        original = edited.read_text()
        bytes_seen = {}

        def deploy_one_file(i: int):
            edited.write_text(original + f"\n# bench edit {i}\n")
            elapsed, out = b.invoke("deploy")
            bytes_seen["one file"] = deploy.parse_describe(out)
            return elapsed

        def deploy_no_change(i: int):
            elapsed, out = b.invoke("deploy")
            bytes_seen["no change"] = deploy.parse_describe(out)
            return elapsed

        tasks = {
            "floor (see Bench.floor)": lambda i: b.floor(),
            "deploy (no change)": deploy_no_change,
            "deploy (one file changed)": deploy_one_file,
            "doctor": lambda i: b.invoke("doctor")[0],
            "status": lambda i: b.invoke("status", "--run", "bench")[0],
            "status --json": lambda i: b.invoke("status", "--run", "bench", "--json")[0],
            "logs -n 20": lambda i: b.invoke("logs", "--run", "bench", "-n", "20")[0],
            "clean-cache": lambda i: b.invoke("clean-cache")[0],
            "deploy --dry-run": lambda i: b.invoke("deploy", "--dry-run")[0],
        }
        unshared = ["floor (see Bench.floor)", "deploy (no change)", "status", "status --json"]
        load_before = os.getloadavg()
        baseline = [b.bare_ssh() for _ in range(args.repeat)]
        times = {}
        for sharing in (True, False):
            b.sharing(sharing)
            for name, fn in tasks.items():
                if not sharing and name not in unshared:
                    continue
                if name == "deploy (no change)":
                    edited.write_text(original)
                    b.invoke("deploy")  # back to the deployed tree, untimed
                times[name if sharing else f"{name}, no sharing"] = [fn(i) for i in range(args.repeat)]
        baseline += [b.bare_ssh() for _ in range(args.repeat)]  # before and after: load drifts
        edited.write_text(original)

        base = statistics.median(baseline)
        print(f"\nbaseline: ssh root@127.0.0.1 '{box.pct} exec {CT} -- true' (OpenSSH, pinned known_hosts): "
              f"median {base * 1000:.0f} ms of {len(baseline)}")
        before, after = (" ".join(f"{x:.2f}" for x in load) for load in (load_before, os.getloadavg()))
        print(f"load average (1, 5, 15 min) before the timed runs: {before}, after: {after}")
        print(f"{'task':<40} {'median s':>9} {'x baseline':>11}   (each {args.repeat} runs of the real CLI)")
        for name, values in times.items():
            med = statistics.median(values)
            print(f"{name:<40} {med:>9.3f} {med / base:>11.2f}")
        for name, numbers in bytes_seen.items():
            print(f"bytes sent, deploy {name}: file content {numbers['bytes_sent']} B in "
                  f"{numbers['files_sent']} file(s), command lines {numbers['line_bytes']} B, "
                  f"{numbers['round_trips']} round trip(s)")
    finally:
        mux.stop(b.master)
        if not args.state:
            sandbox.down(state, purge=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

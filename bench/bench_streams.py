"""Big outputs are read in linear time: `invoke logs -n 50` on a 1 GiB train.log and `invoke metrics`
on a 100 MB metrics.jsonl, on the embedded host, as time and peak memory (maxrss) of the invoke
process, against bare OpenSSH reads of the same files measured in the same run. Then `invoke logs
--follow` of one line of 4, 8 and 16 MiB, its newline last (seconds per MiB: linear when it stays
flat), and of a whole 1 GiB log (`-n` past its line count: peak memory must not grow with it), while
a process in the container holds the runs lock so that the run is alive.

    .venv/bin/python bench/bench_streams.py [--log-mib 1024] [--metrics-mb 100] [--repeat 3]
                                            [--line-mib 4,8,16] [--follow-mib 1024] [--checkout DIR]

Run from the repository root, as root (the embedded host needs it). It brings up its own sandbox,
writes the two files straight into container 200 (no deploy: both tasks read with the container's
system python), and runs the real CLI from a frozen copy of this checkout (or from --checkout DIR, an
older checkout to compare). Baselines: `ssh ... pct exec 200 -- tail -n 50 LOG` and `... tail -c
16777216 METRICS` (the bytes the metrics task reads). Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
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

from dflash_ops import deploy, sandbox  # noqa: E402

CT = "200"
RUN = "/root/runs/big"
# One train.log line as training writes it, and one metrics record as big as a real one.
LOG_LINE = ("12:00:00 INFO step 41/300 | loss 3.1416 | tau 1.43 | acc[1:5] 0.31 0.27 0.22 0.18 "
            "| 2716 tok/s | lr 4.99e-03 | mem 0.56 GiB")
MAKE_METRICS = (
    "import json, sys\n"
    "n, out = int(sys.argv[1]), open(sys.argv[2], 'w')\n"
    "size = step = 0\n"
    "while size < n:\n"
    "    step += 1\n"
    "    line = json.dumps({'kind': 'train', 'step': step, 'loss': 3.0 / step ** 0.1, 'slot_accuracy':\n"
    "                       [0.3] * 15, 'acceptance_length': 1.4, 'worker_loss': [3.0] * 3,\n"
    "                       'tokens_per_s': 2716.2, 'lr': 0.005, 'memory_gib': 0.56, 'time': 1.0}) + '\\n'\n"
    "    out.write(line)\n"
    "    size += len(line)\n")


def measured(argv: list[str], cwd: Path | None = None) -> tuple[float, int, int]:
    """(seconds, peak RSS in MiB of that process, bytes it printed)."""
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        p = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(p.pid, 0)
        elapsed = time.perf_counter() - start
        err = p.stderr.read().decode(errors="replace")
        p.stderr.close()
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"bench: {' '.join(argv[:6])} ... failed: {err.strip()[-400:]}")
        return elapsed, usage.ru_maxrss // 1024, out.seek(0, os.SEEK_END)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-mib", type=int, default=1024, help="size of train.log")
    parser.add_argument("--metrics-mb", type=int, default=100, help="size of metrics.jsonl")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (median shown)")
    parser.add_argument("--line-mib", default="4,8,16", help="sizes of the one long line `logs --follow` "
                        "gets (MiB, comma-separated; empty: skip)")
    parser.add_argument("--follow-mib", type=int, default=1024, help="size of the log `logs --follow "
                        "-n <all>` prints whole (MiB; 0: skip)")
    parser.add_argument("--checkout", help="run the CLI of this checkout instead of a copy of this one")
    args = parser.parse_args()

    state = tempfile.mkdtemp(prefix="dflash-bench-")
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-checkout-"))
    box = sandbox.up(state, containers=(int(CT),), inventory_path=f"{state}/sandbox.yaml")
    checkout = Path(args.checkout).resolve() if args.checkout else deploy.snapshot_checkout(work)
    invoke = [str(REPO / ".venv" / "bin" / "python"), "-m", "invoke"]
    try:
        def in_container(*argv: str) -> None:
            subprocess.run([str(box.pct), "exec", CT, "--", *argv], check=True, timeout=900)

        in_container("mkdir", "-p", RUN)
        in_container("sh", "-c", 'yes "$1" | head -c "$2" > "$3/train.log"; echo big > "$3/../.current"',
                     "sh", LOG_LINE, str(args.log_mib << 20), RUN)
        in_container("python3", "-c", MAKE_METRICS, str(args.metrics_mb * 1000 * 1000),
                     f"{RUN}/metrics.jsonl")
        print(f"setup: {RUN}/train.log {args.log_mib} MiB, metrics.jsonl {args.metrics_mb} MB; "
              f"CLI from {checkout}", flush=True)

        def cli(*task: str) -> list[str]:
            return [*invoke, *task, "--inventory", str(box.inventory), "--ct", CT]

        cases = {
            f"logs -n 50 ({args.log_mib} MiB log)": (cli("logs", "--run", "big", "-n", "50"),
                                                     box.ssh_argv(f"{box.pct} exec {CT} -- tail -n 50 "
                                                                  f"{RUN}/train.log")),
            f"metrics ({args.metrics_mb} MB metrics)": (cli("metrics", "--run", "big"),
                                                        box.ssh_argv(f"{box.pct} exec {CT} -- tail "
                                                                     f"-c 16777216 {RUN}/metrics.jsonl")),
        }
        print(f"\n{'case':<30} {'what':<12} {'median s':>9} {'x bare':>7} {'peak MiB':>9} {'stdout B':>10}")
        for name, (task, bare) in cases.items():
            runs = {"bare ssh": [], "invoke": []}
            for _ in range(args.repeat):  # interleaved: the machine's load drifts
                runs["bare ssh"].append(measured(bare))
                runs["invoke"].append(measured(task, cwd=checkout))
            base = statistics.median(r[0] for r in runs["bare ssh"])
            for what, values in runs.items():
                med = statistics.median(v[0] for v in values)
                print(f"{name:<30} {what:<12} {med:>9.2f} {med / base:>7.1f} {max(v[1] for v in values):>9} "
                      f"{values[-1][2]:>10}", flush=True)
        follow(args, cli, in_container, box, checkout)
    finally:
        sandbox.down(state, purge=True)
        shutil.rmtree(work, ignore_errors=True)


END = "dflash-bench-end"  # the log's last line: the follower has printed everything once it shows it


def tail_of(fd: int, size: int = 4096) -> bytes:
    return os.pread(fd, size, max(0, os.fstat(fd).st_size - size))


def follow_measured(argv, cwd, release) -> tuple[float, int, int]:
    """(seconds until the follower has printed the log's last line, its peak RSS in MiB, bytes printed).
    The run is alive meanwhile (the follower keeps going); `release()` ends it, and the follower."""
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        p = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.PIPE)
        while p.poll() is None and END.encode() not in tail_of(out.fileno()):
            if time.perf_counter() - start > 1800:
                p.kill()
                raise SystemExit(f"bench: {argv[3:6]} did not print the log's end in 30 min")
            time.sleep(0.02)
        elapsed = time.perf_counter() - start
        release()
        _, status, usage = os.wait4(p.pid, 0)
        err = p.stderr.read().decode(errors="replace")
        p.stderr.close()
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"bench: {' '.join(argv[:6])} ... failed: {err.strip()[-400:]}")
        return elapsed, usage.ru_maxrss // 1024, out.seek(0, os.SEEK_END)


def follow(args, cli, in_container, box, checkout) -> None:
    """`logs --follow` of one long line and of the whole log, with the run alive (its wrapper in the
    container holds the runs lock) until the follower has printed it all:
    the time is to the last byte, not the follower's end."""
    lock = f"{RUN}/../.lock"
    release_file = f"{RUN}/release"

    def hold():
        # the run's wrapper (`sh <run>/run.sh`, flock's child: it inherits the lock's fd) holds the lock
        wrapper = f"while [ ! -e {release_file} ]; do sleep 0.1; done"
        in_container("sh", "-c", f'rm -f {release_file} && echo "{wrapper}" > {RUN}/run.sh')
        holder = subprocess.Popen([str(box.pct), "exec", CT, "--", "flock", "-x", lock, "sh",
                                   f"{RUN}/run.sh"])

        def release():
            in_container("touch", release_file)
            holder.wait(timeout=60)
        return release

    def case(name, task, bare, expect):
        mine, theirs = [], []
        for _ in range(args.repeat):
            theirs.append(measured(bare))
            mine.append(follow_measured(task, checkout, hold()))
        med, base = statistics.median(v[0] for v in mine), statistics.median(v[0] for v in theirs)
        mib = expect / (1 << 20)
        print(f"{name:<24} {med:>9.2f} {base:>7.2f} {med / mib:>7.3f} {med / base:>7.1f} "
              f"{max(v[1] for v in mine):>9} {mine[-1][2]:>11}", flush=True)

    print(f"\n{'logs --follow':<24} {'median s':>9} {'bare s':>7} {'s/MiB':>7} {'x bare':>7} {'peak MiB':>9} "
          f"{'stdout B':>11}")
    for mib in [int(x) for x in args.line_mib.split(",") if x.strip()]:
        in_container("sh", "-c", '{ head -c "$1" /dev/zero | tr "\\0" x; printf "\\n%s\\n" "$3"; } '
                     '> "$2/train.log"', "sh", str(mib << 20), RUN, END)
        case(f"one {mib} MiB line", cli("logs", "--follow", "--run", "big"),
             box.ssh_argv(f"{box.pct} exec {CT} -- tail -n 50 {RUN}/train.log"), mib << 20)
    if args.follow_mib:
        in_container("sh", "-c", '{ yes "$1" | head -c "$2"; printf "\\n%s\\n" "$4"; } > "$3/train.log"',
                     "sh", LOG_LINE, str(args.follow_mib << 20), RUN, END)
        case(f"{args.follow_mib} MiB log, whole", cli("logs", "--follow", "--run", "big", "-n", "1000000000"),
             box.ssh_argv(f"{box.pct} exec {CT} -- cat {RUN}/train.log"), args.follow_mib << 20)


if __name__ == "__main__":
    main()

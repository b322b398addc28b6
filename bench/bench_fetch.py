"""Peak memory of `invoke fetch` on a big checkpoint, against the same fetch of a tiny one.

    .venv/bin/python bench/bench_fetch.py [--gib 2] [--state DIR]

Run from the repository root, as root (the embedded host needs it). Brings up its own sandbox (or
reuses --state DIR), plants a checkpoint whose model.safetensors is --gib GiB in container 200 (a
process in the container writes it, as training would), and runs the real CLI under
`/usr/bin/time -v` twice: a 1 KiB checkpoint (the baseline: interpreter, invoke, paramiko) and the
big one. Prints each one's maximum resident set size and wall time, and the ratios. Fetch streams
through a bounded window, so the big fetch's peak should stay near the baseline's (under 100 MB).
The planted weights are random bytes written whole (not sparse): fetch refuses a sparse file.
Not a test: nothing here asserts a figure; the machine may be shared, so read the ratios.

2026-12-01, a shared 2-core machine, --gib 2, each against its own baseline in the same run:
streamed fetch 53.4 MiB peak (1.17x the 45.6 MiB baseline), 147 s; the fetch before (whole files in
memory, commit 581a383) 4165.1 MiB (91x the 45.7 MiB baseline), 407 s.

2026-12-03, the same machine shared by several test runs (load average 19-20 on 2 cores), --gib 1:
the host copy (`pct pull` into the host's /tmp, then `cat` over SSH; 4 + N round trips) 38.5 s,
28 MiB/s beyond the baseline, 50.0 MiB peak (1.19x the 42.2 MiB baseline); each file streamed from
the container (`pct exec ... cat`, nothing on the host; 1 + N round trips) 20.8 s, 53 MiB/s,
49.4 MiB peak (1.17x the 42.2 MiB baseline). Again, one after the other: host copy 35.6 s, 30 MiB/s,
49.5 MiB (1.18x); streamed 18.4 s, 64 MiB/s, 49.7 MiB (1.19x).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_ops import sandbox  # noqa: E402

INVOKE = str(REPO / ".venv" / "bin" / "invoke")
CT = "200"


def plant(box: sandbox.Sandbox, run: str, weights_bytes: int) -> None:
    """A checkpoint written in the container: latest -> step-1 with config.json and the weights."""
    script = ('set -e; d=/root/runs/$1/checkpoints; rm -rf /root/runs/$1; mkdir -p $d/step-1; '
              'printf "{}\\n" > $d/step-1/config.json; '
              'head -c "$2" /dev/urandom > $d/step-1/model.safetensors; printf "step-1\\n" > $d/latest')
    subprocess.run([str(box.pct), "exec", CT, "--", "sh", "-c", script, "sh", run, str(weights_bytes)],
                   check=True, timeout=1800)


def measured_fetch(box: sandbox.Sandbox, run: str, to: Path) -> tuple[int, float]:
    """(peak RSS in KiB, wall seconds) of one `invoke fetch`."""
    argv = ["/usr/bin/time", "-v", INVOKE, "fetch", "--run", run, "--to", str(to),
            "--inventory", str(box.inventory), "--ct", CT]
    start = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=3600)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"fetch failed: {r.stdout}\n{r.stderr}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return peak, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--state", help="sandbox state dir to reuse (default: a fresh temporary one)")
    args = parser.parse_args()
    state = args.state or tempfile.mkdtemp(prefix="bench-fetch-")
    box = sandbox.up(state, containers=(int(CT),), inventory_path=str(Path(state) / "sandbox.yaml"))
    out = Path(tempfile.mkdtemp(prefix="bench-fetch-to-"))
    try:
        big = int(args.gib * 2**30)
        plant(box, "tiny", 1024)
        plant(box, "big", big)
        base_rss, base_wall = measured_fetch(box, "tiny", out / "tiny")
        rss, wall = measured_fetch(box, "big", out / "big")
        got = (out / "big" / "model.safetensors").stat().st_size
        print(f"baseline fetch, 1 KiB weights:   peak RSS {base_rss / 1024:7.1f} MiB   wall "
              f"{base_wall:7.1f} s")
        print(f"fetch, {args.gib:g} GiB weights ({got} bytes): peak RSS {rss / 1024:7.1f} MiB   wall "
              f"{wall:7.1f} s")
        print(f"peak RSS ratio {rss / base_rss:.2f}x the baseline, +{(rss - base_rss) / 1024:.1f} MiB; "
              f"throughput {big / 2**20 / max(wall - base_wall, 1e-9):.0f} MiB/s beyond the baseline's time")
    finally:
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([str(box.pct), "exec", CT, "--", "rm", "-rf", "/root/runs/big", "/root/runs/tiny"],
                       check=False, timeout=600)
        if not args.state:
            sandbox.down(state)
            shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()

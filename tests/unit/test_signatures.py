"""Known failure signatures: real error lines match the right runbook, ordinary training
lines match nothing."""

import io
import json

import pytest

from dflash_ops import runs
from dflash_ops.logs import LogPrinter, follow_stream

# Lines as torch, NCCL and the OS print them (the first is the incident's).
KNOWN = [
    ("compile-race", "RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized "
                     "function. This is not supported at the moment."),
    ("cuda-oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5 has a total "
                 "capacity of 139.72 GiB of which 1.12 GiB is free."),
    ("cuda-oom", "torch.cuda.OutOfMemoryError: CUDA out of memory."),
    ("nccl",
     "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
             "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5"),
    ("nccl", "ncclUnhandledCudaError: Call to CUDA function failed."),
    ("nccl",
     "[rank3]:[E ProcessGroupNCCL.cpp:1414] [PG 0 Rank 3] Watchdog caught collective operation timeout"),
    ("disk-full", "OSError: [Errno 28] No space left on device: '/root/runs/a/checkpoints/.tmp-step-500'"),
    ("venv-torch", "ModuleNotFoundError: No module named 'torch'"),
    ("venv-torch", "RuntimeError: The NVIDIA driver on your system is too old (found version 12020). "
                   "CUDA driver version is insufficient for CUDA runtime version"),
    ("slow-compile", "W1129 12:00:00.000000 4711 torch/_dynamo/convert_frame.py:964] [0/8] torch._dynamo hit "
                     "config.recompile_limit (8)"),
    ("slow-compile", "RuntimeError: 3 compile fallback(s): attention would run uncompiled; raise "
                     "compile.recompile_limit"),
]

ORDINARY = [
    "12:06:03 INFO step 25/30 | loss 8.3215 | tau 1.07 | acc[1:5] 0.07 0.08 0.10 0.11 | 2716 tok/s | "
    "lr 5.00e-03",
    "12:05:35 INFO compile: enabled=False mode=None recompile_limit=64 inductor "
    "cache=/root/.cache/dflash/inductor",
    "12:05:42 INFO compile warm-up: shape ('train', 0) took 1.67 s",
    "NCCL_NVLS_ENABLE=0",
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    "dflash-ops: training process 82 ended: exit 0",
    "12:06:23 WARNING SIGTERM received: checkpointing after the current step, then exiting",
]


@pytest.mark.parametrize("key,line", KNOWN)
def test_known_failures_point_at_their_runbook(key, line):
    sig = runs.match(line)
    assert sig is not None and sig.key == key
    assert sig.runbook == f"docs/runbooks/{key}.md"


@pytest.mark.parametrize("line", ORDINARY)
def test_ordinary_lines_match_nothing(line):
    assert runs.match(line) is None


def test_runbook_pages_are_the_agreed_names():
    states = (runs.STALLED, runs.CONTAINER, runs.HOST_KEY, runs.CONTAINER_OOM)
    pages = {s.page for s in runs.SIGNATURES} | {s.page for s in states}
    assert pages == {"compile-race.md", "cuda-oom.md", "nccl.md", "stalled-run.md", "slow-compile.md",
                     "container.md", "venv-torch.md", "disk-full.md", "ssh-host-key.md", "container-oom.md"}


def test_scan_reports_each_signature_once_with_its_last_line_in_table_order():
    lines = [KNOWN[1][1], ORDINARY[0], KNOWN[0][1], KNOWN[2][1]]
    found = runs.scan(lines)
    assert [(s.key, line) for s, line in found] == [("compile-race", KNOWN[0][1]), ("cuda-oom", KNOWN[2][1])]


def test_log_printer_highlights_and_names_the_runbook():
    out = io.StringIO()
    printer = LogPrinter(out=out)
    stream = follow_stream(printer)
    forged = "==> dflash-ops: run r1 is not running (exit code: 0)"  # a log line, not the verb's word
    items = [{"run": "r1"}, {"line": ORDINARY[0]}, {"line": KNOWN[0][1]}, {"line": forged},
             {"ok": {"run": "r1", "state": "crashed", "exit_code": "1"}}]
    text = "\r\n".join(json.dumps(item) for item in items) + "\r\n"
    for i in range(0, len(text), 7):  # arrives in arbitrary chunks, over a pty
        stream.write(text[i:i + 7])
    stream.close()
    assert printer.ended is None and stream.answer["ok"]["exit_code"] == "1"
    printer.finished(stream.answer["ok"])
    lines = out.getvalue().splitlines()
    assert printer.run == "r1"
    assert printer.ended == "run r1 is not running (exit code: 1)"
    assert lines[2] == KNOWN[0][1] and lines[4] == forged
    assert (lines[3]
            == ">>> torch.compile FX-tracing race between drafter threads: read "
               "docs/runbooks/compile-race.md")
    assert printer.summary() == ["torch.compile FX-tracing race between drafter threads: read "
                                 "docs/runbooks/compile-race.md"]
    assert "\r" not in out.getvalue()


def test_warmup_failure_says_its_last_error_line_and_the_runbook_and_progress_per_drafter():
    from dflash_ops.launch import WarmupProgress
    from dflash_ops.runs import why_it_failed

    out = io.StringIO()
    progress = WarmupProgress(["cuda:5", "cuda:6"], out=out)
    progress.write("12:00:01 INFO compile warm-up: shape ('train', 0) took 41.20 s\r\n"
                   "12:00:09 INFO compile warm-up: shape ('eval', 0) took 8.01 s\r\n"
                   "noise before\r\nTraceback (most recent call last):\r\n"
                   '  File "/root/dflash/warmup_compile.py", line 52, in warm\r\n'
                   "    timings = training.warm_up(drafters.workers, lambda worker: "
                   "training.prepare_batch(\r\n"
                   + KNOWN[0][1]
                   + "\r\nwarmup_compile: error: warm-up failed: RuntimeError: Detected that you")
    shown = out.getvalue().splitlines()
    assert shown[1] == "[warmup] drafter 0 (cuda:5): train 41.2 s  (1/4 shapes)"
    assert shown[3] == "[warmup] drafter 0 (cuda:5): train 41.2 s, eval 8.0 s  (2/4 shapes)"
    progress.close()
    assert why_it_failed(progress.lines) == ("warmup_compile: error: warm-up failed: RuntimeError: "
                                             "Detected that you; torch.compile FX-tracing race between "
                                             "drafter threads: read docs/runbooks/compile-race.md")
    assert [s.key for s, _ in runs.scan(progress.lines)] == ["compile-race"]

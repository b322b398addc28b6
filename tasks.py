"""dflash-ops tasks: `invoke --list` shows them, `invoke --help TASK` explains one.

Glue only: parse flags, pick the target, call one library function. No shell strings here.
"""

from invoke import Collection

from dflash_ops import cli
from dflash_ops.cli import op_task
from dflash_ops.multinode import fans_out
from dflash_ops.errors import UsageError


# --- host keys ------------------------------------------------------------------------------------
@op_task(help={"host": "host name from the inventory",
               "fingerprint": "the SHA256:... fingerprint you verified out of band"})
def trust_host(c, host, fingerprint=None, inventory=None):
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
    h = inv.hosts[host]
    key = transport.HostSession(h).offered_host_key()
    offered = transport.fingerprint(key)
    print(f"{h.name} ({h.address}:{h.port}) offers {key.get_name()} {offered}")
    if fingerprint is None:
        print(f"not pinned: re-run with --fingerprint {offered} once you have checked it on the host")
        return
    if fingerprint.strip() != offered:
        raise UsageError(f"fingerprint mismatch: you gave {fingerprint}, the host offers {offered}; nothing pinned")
    print(f"pinned in {transport.pin_host_key(h, key)}")


# --- the embedded host ----------------------------------------------------------------------------
@op_task(help={"containers": "container ids to create, e.g. 200 or 200,201",
               "hosts": "how many embedded hosts (each its own sshd on 127.0.0.1)",
               "tiny_fit_steps": "fit the tiny target model for this many steps when deploy creates it "
                                 "(its greedy answers then make sense for `invoke regenerate`; 0: random)"})
def sandbox_up(c, containers="200", hosts=1, tiny_fit_steps=0):
    """Start the embedded Proxmox host (sshd on 127.0.0.1 + pct) and write inventory/sandbox.yaml."""
    from dflash_ops import sandbox

    try:
        ids = tuple(int(x) for x in str(containers).split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--containers {containers!r}: give ids such as 200 or 200,201") from None
    _report(sandbox.up(containers=ids, hosts=int(hosts), tiny_fit_steps=int(tiny_fit_steps)))


@op_task
def sandbox_down(c):
    """Stop the embedded host: every container, every sshd; nothing is left running."""
    from dflash_ops import sandbox

    _report(sandbox.down())


@op_task
def sandbox_status(c):
    """Show the embedded host's sshd and containers."""
    from dflash_ops import sandbox

    print(sandbox.status().describe())


def _report(result) -> None:
    for change in result.changed or ("nothing to do: already as asked",):
        print(change)
    print(result.describe())


# --- deploy, doctor, compile caches ---------------------------------------------------------------
@op_task
def deploy(c, ct=None, group=None, dry_run=False, inventory=None):
    """Ship remote_scripts/ into the container, refresh its venv if the requirements changed, check torch.

    Only files whose sha256 differs from the container's copy travel, as one tar over SFTP; the
    container stages a new release from the current one plus those files and swaps the
    `paths.code` symlink to it atomically, so an interrupted deploy leaves the previous release
    whole (the last three releases are kept). The venv (`paths.venv`) is created or refreshed with
    pip only when remote_scripts/requirements.txt changed, with pip's output shown. Ends by checking
    that torch imports in the container and sees the GPUs the inventory's roles name, and creates
    the tiny target model when the inventory asks for one. Nothing changed: one round trip.
    """
    from dflash_ops import deploy as deploy_mod, multinode

    if fans_out(ct, group):
        cli.for_each(c, multinode.deploy_row, ct, group, inventory, dry_run, title="deploy")
        return
    report = deploy_mod.deploy(cli.target(c, ct, inventory, dry_run))
    if not dry_run:
        print(deploy_mod.describe(report))



# --- training runs: warmup, train, logs, status, stop ----------------------------------------------
@op_task(iterable=["set"], help={
    "config": "training config in the container, relative to paths.code (default: the inventory's train_config)",
    "set": "override a config value, key=value (repeatable), passed to the script as given"})
def warmup(c, config=None, set=None, ct=None, inventory=None, dry_run=False):
    """Fill the compile cache the next run reads (same config, env and devices as train).

    Runs warmup_compile.py in the container in the foreground with exactly the config, --set
    values, device lists, environment and compile-cache directories that `invoke train` uses, and
    shows which drafter device has finished which shape. Refused while a run is alive (they would
    share the GPUs and the cache). On failure: non-zero exit and the traceback's last lines, with the
    runbook to read. Ctrl-C stops the warm-up in the container too.
    """
    from dflash_ops import jobs

    jobs.warmup(cli.target(c, ct, inventory, dry_run), config, set or ())


@op_task(iterable=["set"], help={
    "run": "run name (a directory under paths.runs); an existing run resumes from its last checkpoint "
           "(default: the UTC time, e.g. 20260101-120000)",
    "config": "training config in the container, relative to paths.code (default: the inventory's train_config)",
    "set": "override a config value, key=value (repeatable), passed to train_dflash.py as given",
    "max_steps": "stop at this step (the LR schedule still follows train.max_steps)",
    "rdzv_port": "multi-node (--group or several --ct): the rendezvous port on the first container's node"})
def train(c, run=None, config=None, set=None, max_steps=None, ct=None, group=None, inventory=None, dry_run=False,
          rdzv_port=29400):
    """Start a detached training run in the container; refused while another run is alive.

    The run survives this SSH session and your terminal: it is started with `setsid` under a
    small wrapper that records its pid and, when it ends, its exit code or signal. Its directory
    under paths.runs holds train.log, metrics.jsonl, checkpoints/, the config as given and as
    resolved, the environment (secrets masked) and the deployed code version. One run at a time per
    container, enforced by a lock in the container, so two launches at the same moment start one.
    Returns after checking that the process is alive; follow it with `invoke logs --follow`.

    With --group NAME (or --ct 200,201) it is one run over all those containers: each starts it
    under torchrun (c10d rendezvous on the first container's node, --rdzv-port), drafter gradients
    are averaged within each node and then across nodes, global rank 0 writes the checkpoints.
    `status`, `logs` and `stop` with the same --group show and stop every node.
    """
    from dflash_ops import jobs, multinode

    if fans_out(ct, group):
        multinode.launch_group(c, run, config, set or (), int(max_steps) if max_steps is not None else None,
                               ct, group, inventory, dry_run, port=int(rdzv_port))
        return

    t = cli.target(c, ct, inventory, dry_run)
    launched = jobs.launch(t, run, config, set or (), int(max_steps) if max_steps is not None else None)
    if not dry_run:
        print(f"run {launched.run} started on {t.container.label}: pid {launched.pid}, code {launched.code_version}")
        print(f"log: {launched.log} (in the container)")
        print(f"follow it: invoke logs --follow --run {launched.run} --ct {t.container.ctid}")


@op_task(help={"run": "run name (default: the latest run)",
               "n": "how many of the last lines to show",
               "follow": "keep printing new lines until the run ends (Ctrl-C stops following only)"})
def logs(c, run=None, n=50, follow=False, ct=None, group=None, inventory=None, dry_run=False):
    """Show a run's log (the last -n lines), or follow it until the run ends.

    Lines that match a known failure (the torch.compile FX-tracing race, CUDA out of memory, NCCL
    errors, disk full, a broken venv) are highlighted with the runbook to read. `--follow` uses
    `tail -F`, so it keeps up when the log is rotated or the run restarts, and exits when the run
    ends. Ctrl-C or a lost connection stops the follower in the container too; the run goes on.
    """
    from dflash_ops import logs as logs_mod, multinode

    if fans_out(ct, group):  # every line prefixed with its container
        cli.for_each(c, lambda t: multinode.logs_row(t, run, int(n), follow), ct, group, inventory, dry_run,
                     title="logs")
        return
    printer = logs_mod.show(cli.target(c, ct, inventory, dry_run), run, int(n), follow)
    if printer.interrupted:
        print("stopped following; the run goes on")
    for advice in printer.summary():
        print(advice)


@op_task(help={"run": "run name (default: the latest run)",
               "json": "print the facts as JSON for scripts",
               "stall_after": "call a running run stalled after this many seconds without a new log line or metric",
               "watch": "keep the view on screen, refreshed in place every --interval seconds (Ctrl-C stops)",
               "interval": "seconds between refreshes with --watch"})
def status(c, run=None, json=False, stall_after=600, ct=None, group=None, inventory=None, dry_run=False,
           watch=False, interval=5):
    """Show a run's state, progress and the GPUs, in one round trip.

    State: running, stalled (alive, but no new log line or metric for --stall-after seconds),
    finished, crashed (with the exit code or the signal), stopped. Then pid, uptime, last step,
    loss, acceptance length, tokens/s, learning rate, per-GPU utilisation and memory when the
    container has nvidia-smi, and the runbook to read when the log's last lines show a known failure.
    """
    from dflash_ops import multinode, status as status_mod

    if fans_out(ct, group):  # one compact row per container; --json: {container: facts} on stdout
        multinode.status_fan_out(c, run, float(stall_after), json, ct, group, inventory, dry_run)
        return
    t = cli.target(c, ct, inventory, dry_run)
    if watch and not (json or dry_run):
        from dflash_ops import watch as watch_mod
        watch_mod.watch(t, run, float(stall_after), float(interval))
        return
    st = status_mod.gather(t, run, float(stall_after))
    if st is None:
        return
    if json:
        print(st.to_json())
    else:
        status_mod.render(st, t.container.label)


@op_task(help={"run": "run name (default: the latest run)",
               "grace": "seconds to wait after SIGTERM (the run checkpoints) before SIGKILL"})
def stop(c, run=None, grace=30, ct=None, group=None, inventory=None, dry_run=False):
    """Stop a run: SIGTERM (it checkpoints), SIGKILL after --grace seconds, confirm nothing is left.

    Signals the run's whole process group, records "stopped" in the run directory, and checks that
    no process of the run is left and the container's run lock is free.
    """
    from dflash_ops import jobs, multinode

    if fans_out(ct, group):
        cli.for_each(c, lambda t: multinode.stop_row(t, run, float(grace)), ct, group, inventory, dry_run,
                     title="stop")
        return
    t = cli.target(c, ct, inventory, dry_run)
    result = jobs.stop(t, run, float(grace))
    if dry_run:
        return
    if result.outcome == "notalive":
        print(f"run {result.run} on {t.container.label} is not running (exit code: {result.exit_code or 'none'})")
    else:
        how = "SIGTERM" if result.outcome == "term" else f"SIGKILL after {float(grace):g} s"
        print(f"run {result.run} on {t.container.label} stopped ({how}, exit code: {result.exit_code or 'none'}); "
              f"no process left")

@op_task
def doctor(c, ct=None, group=None, dry_run=False, inventory=None):
    """Check the container is ready to train: one line per check, the fix for each that fails.

    One round trip gathers everything: container running, GPUs seen by nvidia-smi against the
    inventory's roles, torch and CUDA versions and the GPUs torch sees, the venv (python runs,
    built from the current requirements), the deployed code against the local remote_scripts/,
    the model directory and its config (a multimodal config's text part), free space in /dev/shm
    and in the runs directory, and the compile caches' size. Exits non-zero if any check fails.
    """
    from dflash_ops import doctor as doctor_mod, multinode

    if fans_out(ct, group):
        cli.for_each(c, multinode.doctor_row, ct, group, inventory, dry_run, title="doctor")
        return
    doctor_mod.doctor(cli.target(c, ct, inventory, dry_run))


@op_task(help={"force": "clean even while a run is alive (its compile caches disappear under it)"})
def clean_cache(c, force=False, ct=None, group=None, dry_run=False, inventory=None):
    """Remove the container's compile caches (inductor, triton, torch extensions) and say what was freed.

    The directories are the inventory's `paths.caches`. Refused while a run is alive (it holds
    the runs lock and uses the caches) unless --force; the next warm-up fills them again.
    """
    from dflash_ops import caches, multinode

    if fans_out(ct, group):
        cli.for_each(c, lambda t: multinode.clean_cache_row(t, force), ct, group, inventory, dry_run,
                     title="clean-cache")
        return
    freed = caches.clean_cache(cli.target(c, ct, inventory, dry_run), force=force)
    if not dry_run:
        print(caches.describe(freed))


# --- the trained drafter: eval, regenerate, metrics, fetch ----------------------------------------
@op_task(name="eval", help={
    "run": "run name (a directory under paths.runs)",
    "checkpoint": "latest, step-N, or a checkpoint directory in the container",
    "prompts": "chat JSONL in the container (default: the run's data.heldout)",
    "num_prompts": "how many held-out prompts (default 16)",
    "max_new_tokens": "longest answer per prompt (default 64)",
    "device": "where the target and drafter run (default: the first target device)"})
def eval_run(c, run, checkpoint="latest", prompts=None, num_prompts=None, max_new_tokens=None, device=None,
             ct=None, inventory=None, dry_run=False):
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

    t = cli.target(c, ct, inventory, dry_run)
    record = evaluate.evaluate(t, run, checkpoint=checkpoint, prompts=prompts, num_prompts=num_prompts,
                               max_new_tokens=max_new_tokens, device=device)
    if record is not None:
        print(evaluate.describe(record))


@op_task(iterable=["src"], help={
    "src": "chat JSONL in the container, relative to paths.code (repeatable; default: data/train.jsonl "
           "and data/heldout.jsonl)",
    "out_dir": "where the regenerated files go, same file names (default: data/ beside paths.runs)",
    "max_new_tokens": "longest regenerated answer (default 256)",
    "limit": "only the first N rows of each file",
    "batch_size": "conversations decoded together (default 32)",
    "device": "where the target runs (default: the first target device)",
    "target": "target checkpoint directory in the container (default: paths.model)"})
def regenerate(c, src=None, out_dir=None, max_new_tokens=None, limit=None, batch_size=None, device=None,
               target=None, ct=None, inventory=None, dry_run=False):
    """Rewrite a dataset's assistant turns with the target's own greedy answers, in the container.

    A drafter is scored on how often it guesses what the target says, so it should learn from what
    the target says. Runs regenerate_data.py with the target at paths.model: each assistant turn is
    replaced by the target's greedy continuation of the conversation so far. Then train on the
    result, e.g. `invoke train --set data.train=/root/data/train.jsonl --set
    data.heldout=/root/data/heldout.jsonl` (the paths this task prints).
    """
    from dflash_ops import evaluate

    t = cli.target(c, ct, inventory, dry_run)
    for stats in evaluate.regenerate(t, sources=src or (), out_dir=out_dir, max_new_tokens=max_new_tokens,
                                     limit=limit, batch_size=batch_size, device=device, target=target):
        print(evaluate.describe_regeneration(stats))


@op_task(help={"run": "run name (default: the latest run)",
               "plot": "also write a PNG here: loss, acceptance length, per-slot accuracy, tokens/s",
               "n": "how many of the last logged steps the table shows (0: all)"})
def metrics(c, run=None, plot=None, n=20, ct=None, inventory=None, dry_run=False):
    """Show a run's recent metrics as a table, and plot the whole run with --plot FILE.png.

    Reads metrics.jsonl and evals.jsonl from the container in one round trip. The table: step, loss,
    held-out loss, acceptance length, accuracy of slots 1-4, tokens/s, learning rate, memory. The plot
    adds held-out points, the dflash evaluations (`invoke eval`) and the checkpoints.
    """
    from rich.console import Console

    from dflash_ops import metrics as metrics_mod

    m = metrics_mod.fetch(cli.target(c, ct, inventory, dry_run), run)
    if m is None:
        return
    Console().print(metrics_mod.table(m, int(n)))
    summary = metrics_mod.eval_summary(m)
    if summary:
        print(summary)
    if plot:
        print(f"plot: {metrics_mod.plot(m, plot)}")


@op_task(help={"run": "run name", "to": "local directory to create (DIR/config.json, DIR/model.safetensors)",
               "checkpoint": "latest or step-N", "force": "replace DIR if it exists",
               "with_state": "also bring training_state.pt (optimizer state, about twice the weights)"})
def fetch(c, run, to, checkpoint="latest", force=False, with_state=False, ct=None, inventory=None,
          dry_run=False):
    """Bring a checkpoint back from the container, verified by sha256 computed in the container.

    The files travel container -> host (`pct pull`) -> here (SFTP) into a temporary directory next to
    DIR, which becomes DIR only when every file's sha256 matches; DIR then loads with
    `DFlashDraftModel.from_pretrained(DIR)`. Refuses to replace an existing DIR unless --force.
    """
    from dflash_ops import fetch as fetch_mod

    fetched = fetch_mod.fetch(cli.target(c, ct, inventory, dry_run), run, to, checkpoint, bool(force),
                              bool(with_state))
    if fetched is not None:
        print(f"{fetched.to}: {len(fetched.files)} files from {fetched.checkpoint}, "
              f"{fetched.total_bytes / 2**20:.1f} MiB, sha256 verified")


sandbox_ns = Collection("sandbox")
sandbox_ns.add_task(sandbox_up, "up")
sandbox_ns.add_task(sandbox_down, "down")
sandbox_ns.add_task(sandbox_status, "status")

ns = Collection(trust_host, sandbox_ns, deploy, warmup, train, logs, status, stop, doctor, clean_cache, eval_run, regenerate, metrics, fetch)
ns.configure({"dflash": {"inventory": None}})

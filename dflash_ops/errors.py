"""One error family and one exit-code table. Every message is one line that says what went wrong and
what to do next; every error class names its exit status from `ExitStatus`, one meaning per code."""

from enum import IntEnum, unique


@unique
class ExitStatus(IntEnum):
    """What a task's exit code means. docs/runbooks/README.md's table is `exit_code_table()`."""

    def __new__(cls, value: int, meaning: str):
        member = int.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member

    OK = 0, "success"
    CHECK_FAILED = 1, ("`doctor` found a failed readiness check (each failed line names its fix); "
                       "`conformance`: the host's pct failed a check of the contract")
    USAGE = 2, "bad input: a flag, a `--set`, the inventory, or a value that cannot reach a shell safely"
    UNREACHABLE = 3, ("the host cannot be reached, refused authentication, or its host key is not pinned "
                      "or changed")
    CONTAINER = 4, "the container is stopped or does not exist"
    REMOTE_FAILED = 5, "a command on the host or in the container failed (deploy, warm-up, launch)"
    RUN_STATE = 6, ("run state: a run is alive when the task needs none, or the named run or checkpoint "
                    "is missing")
    SANDBOX = 7, "the embedded test host could not be brought up, inspected or taken down"
    FAN_OUT_FAILED = 8, "a task run over several containers failed on at least one (its row says why)"
    CHECKSUM_MISMATCH = 9, ("`fetch`: a copied file does not match the hash computed in the container; "
                            "`stage`: the target's copy does not match its recorded sha256")
    NOT_LOSSLESS = 10, "`eval`: speculative decoding changed the target's greedy output"
    UNTRUSTED = 11, ("what the container wrote was refused as unsafe (`fetch`: a checkpoint outside the run, "
                     "a symlink, a name that is not the checkpoint's, a sparse file, a checkpoint past "
                     "`--max-size` or its expected size)")
    PREFLIGHT = 12, ("a check before the work failed in the container (the line names the fix), nothing "
                     "was started: `train`'s preflight, or a path `warmup`, `eval` or `regenerate` needs")
    TIMED_OUT = 13, ("a task's work on the host or in the container ran past its deadline (`--timeout`, "
                     "or the task's own): it was ended there, its process group with it")
    INTERRUPTED = 130, "interrupted with Ctrl-C"
    BROKEN_PIPE = 141, "the reader of the output went away (`head` closed the pipe): stopped quietly"


def exit_code_table() -> str:
    """The runbooks' exit-code table (markdown), generated from `ExitStatus`."""
    rows = [f"| `{s.value}` | {s.meaning} |" for s in ExitStatus]
    return "\n".join(["| exit | meaning |", "| --- | --- |", *rows])


class DflashOpsError(Exception):
    """Base class: tasks turn any of these into a one-line message and the class's exit status.

    A subclass names its status in its class line: `class UsageError(DflashOpsError,
    exit_status=ExitStatus.USAGE)`; without one it keeps its parent's.
    """

    exit_status = ExitStatus.CHECK_FAILED

    def __init_subclass__(cls, exit_status: ExitStatus | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if exit_status is not None:
            cls.exit_status = ExitStatus(exit_status)  # a code that is not in the table fails here


class InventoryError(DflashOpsError, exit_status=ExitStatus.USAGE):
    """The inventory file is missing, malformed or names something that does not exist."""


class UsageError(DflashOpsError, exit_status=ExitStatus.USAGE):
    """Conflicting or invalid command-line values."""


class UnsafeValue(DflashOpsError, exit_status=ExitStatus.USAGE):
    """A value cannot be passed to a shell safely (NUL byte, undecodable bytes, bad env name)."""


class ConnectError(DflashOpsError, exit_status=ExitStatus.UNREACHABLE):
    """The host could not be reached or would not let us in."""


class HostUnreachable(ConnectError):
    pass


class AuthFailed(ConnectError):
    pass


class SudoRefused(AuthFailed, exit_status=ExitStatus.UNREACHABLE):
    """`become: sudo`: sudo wants a password to run pct (`sudo -n` never asks for one)."""


class HostKeyError(ConnectError):
    """The host's key is not pinned, or differs from the pinned one: never trusted silently."""


class HostKeyUnknown(HostKeyError):
    pass


class HostKeyChanged(HostKeyError):
    pass


class ContainerError(DflashOpsError, exit_status=ExitStatus.CONTAINER):
    pass


class ContainerMissing(ContainerError):
    pass


class ContainerStopped(ContainerError):
    pass


class RemoteCommandFailed(DflashOpsError, exit_status=ExitStatus.REMOTE_FAILED):
    """A command on the host or in the container exited non-zero."""

    def __init__(self, message, exited=None, stderr_tail=""):
        super().__init__(message)
        self.exited = exited
        self.stderr_tail = stderr_tail


class TimedOut(RemoteCommandFailed, exit_status=ExitStatus.TIMED_OUT):
    """A command ran past its deadline. The transport closed its SSH session, and the session's end
    ends the command's process group in the container (commands.SESSION_SCRIPT: the group it made
    itself, never a pid read from the container)."""


class DeployError(DflashOpsError, exit_status=ExitStatus.REMOTE_FAILED):
    """The payload is incomplete here, or the container's torch or GPUs are not what its roles say."""


class RunStateError(DflashOpsError, exit_status=ExitStatus.RUN_STATE):
    """A run is (or is not) alive when the task needs the opposite."""


class NoSuchRun(RunStateError):
    """The named run (or a latest one) is not in the container: one line for every task that takes
    --run (dflash_ops/runs.py no_such_run words it)."""


class UntrustedData(DflashOpsError, exit_status=ExitStatus.UNTRUSTED):
    """The container answered with something that would escape the place the operator chose."""


class PreflightFailed(DflashOpsError, exit_status=ExitStatus.PREFLIGHT):
    """`train`'s preflight in the container refused the launch (target, data, devices, config, space)."""


class FanOutFailed(DflashOpsError, exit_status=ExitStatus.FAN_OUT_FAILED):
    """At least one container of a fan-out failed (each one's row says why)."""


if __name__ == "__main__":
    print(exit_code_table())

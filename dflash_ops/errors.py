"""One error family. Every message is one line that says what went wrong and what to do next."""


class DflashOpsError(Exception):
    """Base class: tasks turn any of these into a one-line message and a non-zero exit."""

    exit_code = 1


class InventoryError(DflashOpsError):
    """The inventory file is missing, malformed or names something that does not exist."""

    exit_code = 2


class UsageError(DflashOpsError):
    """Conflicting or invalid command-line values."""

    exit_code = 2


class UnsafeValue(DflashOpsError):
    """A value cannot be passed to a shell safely (NUL byte, undecodable bytes, bad env name)."""

    exit_code = 2


class ConnectError(DflashOpsError):
    """The host could not be reached or would not let us in."""

    exit_code = 3


class HostUnreachable(ConnectError):
    pass


class AuthFailed(ConnectError):
    pass


class HostKeyError(ConnectError):
    """The host's key is not pinned, or differs from the pinned one: never trusted silently."""


class HostKeyUnknown(HostKeyError):
    pass


class HostKeyChanged(HostKeyError):
    pass


class ContainerError(DflashOpsError):
    exit_code = 4


class ContainerMissing(ContainerError):
    pass


class ContainerStopped(ContainerError):
    pass


class RemoteCommandFailed(DflashOpsError):
    """A command on the host or in the container exited non-zero."""

    exit_code = 5

    def __init__(self, message, exited=None, stderr_tail=""):
        super().__init__(message)
        self.exited = exited
        self.stderr_tail = stderr_tail


class RunStateError(DflashOpsError):
    """A run is (or is not) alive when the task needs the opposite."""

    exit_code = 6


class FanOutFailed(DflashOpsError):
    """At least one container of a fan-out failed (each one's row says why)."""

    exit_code = 8

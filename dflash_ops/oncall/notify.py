"""Where `invoke watch` sends its events: a chat webhook and/or a local command, off the watch's thread.

Each sink is an `Outbox`: a queue and one background thread that delivers the events in order and
retries a failed delivery with exponential backoff. `send()` never waits, so a slow or dead
receiver never delays the next poll; a delivery that still fails after the last attempt is
reported (one line, through `report`) and dropped, and the watch goes on.

- `Webhook(url)`: POSTs `{"text": ..., "event": {...}}` (Slack/Mattermost incoming-webhook style:
  they show `text`, made by terminal.chat: no mention, Markdown link or image of the log's reaches the
  channel). The URL comes from a file or the environment (`webhook_url`), never from argv, where every
  local user could read it for the watch's whole life. Credentials in the URL (user:password@, tokens in
  the path or query, as Slack's /services/T../B../secret) never appear in what we print: `mask_url`
  keeps the scheme, host and port only, and every error text is scrubbed of the URL's parts. The Basic
  credentials are sent to the URL's own host only, never again on a redirect.
- `Command(cmd)`: runs a local command with the event JSON on stdin. The command is split like a
  shell would (shlex) and run as an argv, without a shell, so nothing in an event can become a
  command; give `sh -c '...'` yourself when you need pipes or redirection.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shlex
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request

from .. import localfiles
from ..errors import UsageError
from ..terminal import chat

_STOP = object()


class Outbox:
    """Deliver payloads in order on a background thread; retry with backoff; report what failed."""

    name = "sink"

    def __init__(self, report, attempts: int = 5, backoff: float = 1.0, max_backoff: float = 30.0):
        self.report, self.attempts, self.backoff, self.max_backoff = report, attempts, backoff, max_backoff
        self.delivered = self.failed = 0
        self._queue: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._work, name=f"dflash-{self.name}", daemon=True)
        self._thread.start()

    def send(self, event: dict) -> None:
        self._queue.put(event)

    def deliver(self, event: dict) -> None:  # raises on failure
        raise NotImplementedError

    def _work(self) -> None:
        while (event := self._queue.get()) is not _STOP:
            delay = self.backoff
            for attempt in range(1, self.attempts + 1):
                try:
                    self.deliver(event)
                    self.delivered += 1
                    break
                except Exception as exc:  # noqa: BLE001 (a receiver's failure is reported, never raised into the watch)
                    why = self.scrub(f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc))
                    if attempt == self.attempts:
                        self.failed += 1
                        self.report(f"{self.name}: event {event.get('event')!r} not delivered after "
                                    f"{attempt} attempt(s): {why}")
                    else:
                        closing = self._closing.is_set()  # the watch is ending and waits for us: no backoff
                        self.report(f"{self.name}: attempt {attempt} for event {event.get('event')!r} failed "
                                    f"({why}); "
                                    + ("retrying now (exiting)" if closing else f"retrying in {delay:g} s"))
                        if not closing:
                            self._closing.wait(delay)
                        delay = min(delay * 2, self.max_backoff)

    def scrub(self, text: str) -> str:
        return text

    def close(self, wait: float = 10.0) -> int:
        """Deliver what is queued within `wait` seconds; returns how many events were left undelivered."""
        self._queue.put(_STOP)
        self._closing.set()
        self._thread.join(wait)
        left = self._queue.qsize() + (1 if self._thread.is_alive() else 0)
        if self._thread.is_alive():
            self.report(f"{self.name}: gave up on {left} undelivered event(s) at exit")
        return left if self._thread.is_alive() else 0


WEBHOOK_ENV = "DFLASH_WEBHOOK_URL"
WEBHOOK_FILE_MAX = 8192


def webhook_url(webhook_file: str | None = None, old_flag: str | None = None) -> str | None:
    """The webhook URL: the first line of `webhook_file` (a regular file only this user can read), or
    $DFLASH_WEBHOOK_URL; None when neither is given. `--webhook URL` itself is refused in one line."""
    if old_flag:
        raise UsageError("--webhook URL puts the URL and its credentials in the process list for the "
                         "watch's whole life: write it to a file (chmod 600) and give --webhook-file "
                         f"FILE, or export {WEBHOOK_ENV}")
    if webhook_file is None:
        return os.environ.get(WEBHOOK_ENV) or None
    path = os.path.expanduser(webhook_file)
    try:
        data = localfiles.read_regular(path, WEBHOOK_FILE_MAX, "webhook file")
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UsageError(f"--webhook-file {webhook_file}: no such file") from None
    if mode & 0o077:
        raise UsageError(f"--webhook-file {webhook_file}: group or others may read it (mode "
                         f"{mode & 0o777:04o}), and it holds credentials: run `chmod 600 {webhook_file}`")
    lines = data.decode("utf-8", "replace").strip().splitlines()
    if not lines:
        raise UsageError(f"--webhook-file {webhook_file}: empty; write the webhook URL on its first line")
    return lines[0].strip()


def mask_url(url: str) -> str:
    """scheme://host:port/*** : what may be printed of a webhook URL."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "?"
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    userinfo = "***@" if "@" in parts.netloc else ""
    rest = "/***" if (parts.path.strip("/") or parts.query or parts.fragment) else ""
    return f"{parts.scheme}://{userinfo}{host}{port}{rest}"


class Webhook(Outbox):
    def __init__(self, url: str, report, timeout: float = 10.0, **kwargs):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"--webhook {mask_url(url)}: expected an http:// or https:// URL with a host")
        try:
            _ = parts.port
        except ValueError:
            raise UsageError(f"--webhook {mask_url(url)}: the port is not a number") from None
        self.url, self.timeout, self.shown = url, timeout, mask_url(url)
        self.name = f"webhook {self.shown}"
        # urllib does not send URL userinfo: it becomes a Basic authorization header.
        netloc = parts.netloc.rpartition("@")[2]
        self._target = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
        self._auth = None
        if parts.username is not None:
            pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            self._auth = "Basic " + base64.b64encode(pair.encode()).decode()
        userinfo = parts.netloc.rpartition("@")[0]
        self._secrets = sorted({s for s in (url, self._target, userinfo, parts.username, parts.password,
                                            parts.path, parts.query, parts.fragment,
                                            *parts.path.split("/"),
                                            *(v for _, v in urllib.parse.parse_qsl(parts.query)))
                                if s and len(s) > 1 and s not in (parts.hostname, "/")}, key=len,
                               reverse=True)
        super().__init__(report, **kwargs)

    def scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def deliver(self, event: dict) -> None:
        body = json.dumps({"text": chat(event["text"]), "event": event}).encode()
        request = urllib.request.Request(self._target, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        if self._auth:  # unredirected: urllib does not copy it into a redirect's request (to any host)
            request.add_unredirected_header("Authorization", self._auth)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read(1 << 16)
        except urllib.error.HTTPError as exc:
            raise OSError(f"HTTP {exc.code} {exc.reason}") from None
        except urllib.error.URLError as exc:
            raise OSError(f"cannot reach {self.shown}: {exc.reason}") from None


class Command(Outbox):
    def __init__(self, cmd: str, report, timeout: float = 60.0, **kwargs):
        try:
            self.argv = shlex.split(cmd)
        except ValueError as exc:
            raise UsageError(f"--notify-cmd {cmd[:80]!r}: {exc}") from None
        if not self.argv:
            raise UsageError("--notify-cmd: empty command")
        self.timeout = timeout
        self.name = f"notify-cmd {self.argv[0]}"
        kwargs.setdefault("attempts", 1)  # a command that failed half-way (a mail sent?) is not re-run
        super().__init__(report, **kwargs)

    def deliver(self, event: dict) -> None:
        r = subprocess.run(self.argv, input=json.dumps(event) + "\n", capture_output=True, text=True,
                           timeout=self.timeout, check=False)
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or [""])[-1][:200]
            raise OSError(f"exit {r.returncode}" + (f": {tail}" if tail else ""))

"""Webhook and command sinks of `invoke watch`, against a real HTTP server on 127.0.0.1."""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_ops.errors import UsageError
from dflash_ops.oncall import notify


class Receiver:
    """An incoming-webhook stand-in: records each POST (path, headers, JSON); answers `codes` in turn."""

    def __init__(self, codes=()):
        self.posts, self.codes = [], list(codes)
        self.got = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                code = receiver.codes.pop(0) if receiver.codes else 200
                with receiver.got:
                    receiver.posts.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                           "code": code, "json": json.loads(body)})
                    receiver.got.notify_all()
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, n, timeout=30):
        with self.got:
            assert self.got.wait_for(lambda: len(self.posts) >= n, timeout), self.posts
        return self.posts

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def event(kind="stalled", text="run x stalled"):
    return {"event": kind, "text": text, "run": "x"}


def test_webhook_posts_text_and_event_in_order(receiver):
    reports = []
    hook = notify.Webhook(f"http://127.0.0.1:{receiver.port}/hooks/abc", reports.append, backoff=0.01)
    for kind in ("watching", "stalled", "recovered"):
        hook.send(event(kind, f"run x {kind}"))
    assert hook.close() == 0
    posts = receiver.wait(3)
    assert [p["json"]["text"] for p in posts] == ["run x watching", "run x stalled", "run x recovered"]
    assert posts[1]["json"]["event"] == event("stalled", "run x stalled")
    assert reports == [] and hook.delivered == 3


def test_webhook_text_from_a_log_line_cannot_ping_or_drive_a_terminal(receiver):
    hook = notify.Webhook(f"http://127.0.0.1:{receiver.port}/h", print, backoff=0.01)
    hook.send(event("signature", "NCCL error in the log: <!channel> x & y \x1b]52;c;cGF5bG9hZA==\x07"))
    hook.send(event("crashed", "RuntimeError: @channel @all @here ask @alice [click](http://evil.example/a) "
                               "![pixel](https://evil.example/p.png) see http://evil.example\u2028next"))
    hook.close()
    first, second = (p["json"]["text"] for p in receiver.wait(2))
    assert first == "NCCL error in the log: &lt;!channel&gt; x &amp; y ^[]52;c;cGF5bG9hZA==^G"
    z = "\u200b"  # a zero-width space: the text reads the same, nothing is a mention, a link or an image
    assert second == (f"RuntimeError: @{z}channel @{z}all @{z}here ask @{z}alice "
                      f"[click]{z}(http:{z}//evil.example/a) !{z}[pixel]{z}(https:{z}//evil.example/p.png) "
                      f"see http:{z}//evil.example&lt;U+2028&gt;next")


def test_basic_credentials_are_not_sent_again_on_a_redirect():
    """A 302 from the webhook's host names another host (urllib follows it, as a GET): the request goes
    there without the Authorization header."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # the webhook's host: redirects
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/elsewhere")
            self.end_headers()

        def do_GET(self):  # the host the redirect names (another name, the same test server)
            seen.append((self.headers.get("Host"), self.headers.get("Authorization")))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        hook = notify.Webhook(f"http://bot:s3cret@127.0.0.1:{server.server_address[1]}/h", print, attempts=1)
        hook.send(event())
        assert hook.close() == 0 and hook.delivered == 1
        assert seen == [(f"localhost:{server.server_address[1]}", None)]
    finally:
        server.shutdown()
        server.server_close()


def test_the_webhook_url_comes_from_a_private_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(notify.WEBHOOK_ENV, raising=False)
    assert notify.webhook_url() is None
    monkeypatch.setenv(notify.WEBHOOK_ENV, "https://hooks.example/env")
    assert notify.webhook_url() == "https://hooks.example/env"
    hook = tmp_path / "hook"
    hook.write_text("https://bot:pw@hooks.example/file\n")
    hook.chmod(0o600)
    assert notify.webhook_url(str(hook)) == "https://bot:pw@hooks.example/file"
    hook.chmod(0o644)
    with pytest.raises(UsageError, match=r"group or others may read it \(mode 0644\).*chmod 600"):
        notify.webhook_url(str(hook))
    with pytest.raises(UsageError) as old:
        notify.webhook_url(None, "https://bot:pw@hooks.example/argv")
    assert "pw" not in str(old.value) and "--webhook-file FILE" in str(old.value)
    assert "\n" not in str(old.value)


def test_webhook_retries_a_failing_receiver_with_backoff_then_delivers():
    r = Receiver(codes=[500, 503])
    try:
        reports = []
        hook = notify.Webhook(f"http://127.0.0.1:{r.port}/x", reports.append, backoff=0.01)
        hook.send(event())
        assert [p["code"] for p in r.wait(3)] == [500, 503, 200]
        assert hook.close() == 0
        assert reports[0] == (f"webhook http://127.0.0.1:{r.port}/***: attempt 1 for event 'stalled' failed "
                              "(HTTP 500 Internal Server Error); retrying in 0.01 s")
        assert "attempt 2" in reports[1] and hook.delivered == 1 and hook.failed == 0
    finally:
        r.close()


def test_unreachable_webhook_is_retried_then_reported_and_send_never_blocks():
    import socket

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reports = []
    hook = notify.Webhook(f"http://127.0.0.1:{port}/hook", reports.append, attempts=3, backoff=0.01)
    hook.send(event("crashed"))
    hook.send(event("finished"))
    assert hook.close(wait=30) == 0
    assert hook.failed == 2 and hook.delivered == 0
    assert sum("retrying" in line for line in reports) == 4
    assert reports[2] == (f"webhook http://127.0.0.1:{port}/***: event 'crashed' not delivered after 3 "
                          f"attempt(s): cannot reach http://127.0.0.1:{port}/***: [Errno 111] "
                          "Connection refused")


def test_credentials_in_the_url_never_show_but_are_sent(receiver):
    url = f"http://bot:s3cret-pw@127.0.0.1:{receiver.port}/services/T000/B000/XXXXtoken?key=abcdef123"
    assert notify.mask_url(url) == f"http://***@127.0.0.1:{receiver.port}/***"
    reports = []
    hook = notify.Webhook(url, reports.append, backoff=0.01)
    assert "s3cret" not in hook.name and "XXXXtoken" not in hook.name
    hook.send(event())
    hook.close()
    post = receiver.wait(1)[0]
    assert post["path"] == "/services/T000/B000/XXXXtoken?key=abcdef123"
    assert post["auth"] == "Basic Ym90OnMzY3JldC1wdw=="  # bot:s3cret-pw
    assert hook.scrub(f"failed for {url} (XXXXtoken, abcdef123)") == "failed for *** (***, ***)"
    with pytest.raises(UsageError) as bad:
        notify.Webhook("ftp://u:pw-secret@host.example/tok3n", reports.append)
    assert "pw-secret" not in str(bad.value) and "tok3n" not in str(bad.value)
    assert (str(bad.value)
            == "--webhook ftp://***@host.example/***: expected an http:// or https:// URL with a host")


def test_notify_command_gets_the_event_json_on_stdin_without_a_shell(tmp_path):
    out = tmp_path / "events.jsonl"
    script = tmp_path / "append.py"
    script.write_text("import sys\nopen(sys.argv[1], 'a').write(sys.stdin.read())\n")
    reports = []
    cmd = notify.Command(f"{sys.executable} {script} '{out}'", reports.append)
    hostile = event("signature", "x; touch $(echo pwned) `id` && rm -rf /nonexistent")
    cmd.send(hostile)
    assert cmd.close() == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == [hostile]
    assert not (tmp_path / "pwned").exists() and reports == []

    failing = notify.Command(f"{sys.executable} -c 'import sys; sys.exit(\"no mail server\")'",
                             reports.append)
    failing.send(event())
    failing.close()
    assert reports == [f"notify-cmd {sys.executable}: event 'stalled' not delivered after 1 attempt(s): "
                       "exit 1: no mail server"]
    with pytest.raises(UsageError):
        notify.Command("unterminated 'quote", reports.append)

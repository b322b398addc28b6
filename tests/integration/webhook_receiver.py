"""A Slack/Mattermost-style incoming webhook on 127.0.0.1 for the `invoke watch` tests."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SECRET_URL_PARTS = ("hunter2", "T0001", "B0002", "SECRETtoken")


class Receiver:
    """Every POST's JSON body, in order; `url` carries credentials and a token (SECRET_URL_PARTS)."""

    def __init__(self):
        self.bodies = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                receiver.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = (f"http://bot:hunter2@127.0.0.1:{self.server.server_address[1]}"
                    "/services/T0001/B0002/SECRETtoken")

    def kinds(self):
        return [b["event"]["event"] for b in self.bodies]

    def close(self):
        self.server.shutdown()
        self.server.server_close()

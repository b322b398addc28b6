"""Text from a container or a host, made safe to show on the operator's terminal.

What a container writes (train.log, run files, a model's config.json, checkpoint names, stderr) is
data chosen by code the operator did not write. Shown raw, it drives the terminal: ESC sequences
set the window title, write the clipboard (OSC 52), clear the screen or plant hyperlinks (OSC 8);
shown through rich, `[link=file:///...]` renders and a stray `[/]` raises MarkupError.

`visible(data)` is THE function: every control character, escape sequence and undecodable byte
becomes visible text (ESC -> `^[`, DEL -> `^?`, a C1 control -> `<U+009B>`, a bad byte -> `\\xff`).
`markup(data)` is the same text escaped for a rich markup string, and `console()` the rich Console
to print it with (no emoji codes, no highlighting, so what is printed is exactly the text).
`logs --raw` is the one path that writes container bytes untouched, because the operator asked.

One filter per sink, each starting from `visible()`:
- the terminal: `visible()`/`markup()`, and `Visible(stream)` for output streamed as it comes (deploy's
  pip and tiny-target build, any remote stream the transport shows);
- a chat message: `chat()` (mentions, links and images neutralized, `<>&` escaped);
- a monitoring-plugin line: `plugin()` (one line whatever Unicode line break it held, no `|`).
"""

from __future__ import annotations

import re
import sys

# Bidirectional overrides and isolates reorder what is shown ("Trojan source"); line and
# paragraph separators break lines on some terminals. Not controls, but shown the same way.
_REORDERING = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u2028\u2029"
_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f" + _REORDERING + "\ud800-\udfff]")
_UNSAFE_KEEP_NEWLINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f" + _REORDERING + "\ud800-\udfff]")


def _show(match: re.Match) -> str:
    char = match.group()
    code = ord(char)
    if code < 0x20:
        return "^" + chr(code + 0x40)         # caret notation, as `cat -v` and terminals echo it
    if code == 0x7F:
        return "^?"
    if 0xDC80 <= code <= 0xDCFF:              # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return f"<U+{code:04X}>"


def visible(data: str | bytes, newlines: bool = False) -> str:
    """Untrusted text -> text with no control character: safe to write to a terminal as is.

    Bytes are decoded as UTF-8; a byte that is not UTF-8 shows as `\\xNN`. Tab stays. Newlines
    become `^J` unless `newlines` (multi-line text such as a remote stderr tail).
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data).decode("utf-8", errors="backslashreplace")
    elif not isinstance(data, str):
        data = str(data)
    return (_UNSAFE_KEEP_NEWLINES if newlines else _UNSAFE).sub(_show, data)


def markup(data: str | bytes, newlines: bool = False) -> str:
    """Untrusted text -> a rich markup string that renders to exactly `visible(data)`.

    Safe alone and inside a template (`f"[red]{markup(x)}[/red]"`). rich.markup.escape is not
    enough: rich also turns a plain `\\[` into `[`, and a trailing backslash escapes the next tag.
    """
    return _BRACKET.sub(_escape_bracket, visible(data, newlines))


# A run of backslashes followed by `[` (a tag if rich's tag pattern matches there), or at the end.
_BRACKET = re.compile(r"(\\*)(?:(\[(?=[a-z#/@][^\[]*?\]))|(\[)|$)")


def _escape_bracket(match: re.Match) -> str:
    backslashes, tag, bracket = match.groups()
    k = len(backslashes)
    if bracket:                        # not a tag: rich shows `\\[` as `[`, other backslashes as they are
        return "\\" * (k + 1) + "["
    if tag:                            # a tag: 2k backslashes are k literal ones, one more escapes the tag
        return "\\" * (2 * k + 1) + "["
    if k:                              # trailing backslashes: an empty tag pair after them, so that they
        return "\\" * (2 * k) + "[bold][/bold]"  # stay k literal ones whatever tag the template adds
    return ""


class Visible:
    """A file-like stream that writes what it is given through `visible(..., newlines=True)`: remote
    output streamed as it comes (pip's, a script's) reaches the terminal with its escapes shown."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(visible(text, newlines=True))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


# Every line boundary Python's str.splitlines() knows (CR, LF, VT, FF, FS, GS, RS, NEL, LS, PS).
LINE_BREAKS = re.compile("\r\n|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def plugin(data: str | bytes) -> str:
    """Untrusted text -> one monitoring-plugin line: every Unicode line break becomes a space BEFORE
    anything is split or shown (a U+2028 in a run file was a plugin line of its own, a fake `OK - ...`),
    then `visible()`, and no `|` (it starts the performance data)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data).decode("utf-8", errors="backslashreplace")
    return visible(LINE_BREAKS.sub(" ", str(data))).replace("|", "<U+007C>")


# Chat markup that a log line must not carry into a channel: a mention pages people (@channel, @all,
# @here, @user), a Markdown link or image ([t](u), ![a](u)) or a bare URL renders as a link or fetches
# an image from the container's choice of server. A zero-width space breaks each without hiding it.
_ZWSP = "\u200b"
_MENTION = re.compile(r"@(?=\w)")
_LINK = re.compile(r"([\]!])(?=[(\[])")
_URL = re.compile(r"(?<=\w):(?=//)")


def chat(data: str | bytes) -> str:
    """Untrusted text -> the text of a chat message (Slack/Mattermost webhook): `visible()` (one line,
    no control byte), `<`, `>`, `&` escaped as Slack asks (`<!channel>`, `<url|text>`), and every
    mention, Markdown link or image and URL broken by a zero-width space (Mattermost renders them)."""
    text = visible(data).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = _MENTION.sub("@" + _ZWSP, text)
    text = _LINK.sub(lambda m: m.group(1) + _ZWSP, text)
    return _URL.sub(":" + _ZWSP, text)


def console(**options):
    """A rich Console that prints escaped untrusted text as it is: no `:emoji:` codes, no highlighting."""
    from rich.console import Console

    options.setdefault("emoji", False)
    options.setdefault("highlight", False)
    return Console(**options)


class LineSink:
    """A file-like `out_stream` for the transport: hands each complete line of remote output to `line`.

    pty output ends lines with CR LF and progress bars redraw with CR: both are dropped. A line is
    kept in pieces until its end comes and joined once: linear in its length (appending to one string
    and splitting it again at every read was quadratic, 281 s for a 16 MiB line).
    """

    out = None

    def write(self, data: str) -> int:
        pieces = self.__dict__.setdefault("_pieces", [])
        *complete, rest = data.replace("\r", "").split("\n")
        if complete:
            pieces.append(complete[0])
            complete[0] = "".join(pieces)
            pieces.clear()
            for line in complete:
                self.line(line)
        if rest:
            pieces.append(rest)
        return len(data)

    def flush(self) -> None:
        (self.out or sys.stdout).flush()

    def close(self) -> None:
        pieces = self.__dict__.setdefault("_pieces", [])
        if pieces:
            partial = "".join(pieces)
            pieces.clear()
            self.line(partial)

    def line(self, line: str) -> None:
        raise NotImplementedError

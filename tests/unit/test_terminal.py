"""terminal.visible / markup: nothing a container writes reaches the terminal as a control byte or markup."""

import io
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.errors import MarkupError
from rich.text import Text

from dflash_ops import terminal

ESCAPES = {
    "title": b"\x1b]0;pwned\x07",
    "osc52 clipboard": b"\x1b]52;c;ZWNobyBwd25lZA==\x07",
    "screen clear": b"\x1b[2J\x1b[H",
    "osc8 hyperlink": b"\x1b]8;;file:///etc/passwd\x1b\\click\x1b]8;;\x1b\\",
    "c1 csi": "\x9b2J".encode(),
}
MARKUP = ["[link=file:///etc/passwd]x[/link]", "[/]", "[bold red]alarm", "\\[/]", "x\\", "[@click=quit]y[/]"]


@pytest.mark.parametrize("raw", ESCAPES.values(), ids=ESCAPES.keys())
@pytest.mark.parametrize("kind", [bytes, str])
def test_escape_sequences_are_visible(raw, kind):
    data = raw if kind is bytes else raw.decode()
    shown = terminal.visible(data)
    assert "\x1b" not in shown and "\x07" not in shown and "\x9b" not in shown
    assert shown.isprintable()


def test_caret_notation_and_the_rest():
    assert terminal.visible(b"\x1b[31mred\x7f\x00") == "^[[31mred^?^@"
    assert terminal.visible("a\tb\nc\rd") == "a\tb^Jc^Md"
    assert terminal.visible("a\nb\r\n", newlines=True) == "a\nb^M\n"
    assert terminal.visible("\x85\u202egnp.exe") == "<U+0085><U+202E>gnp.exe"
    assert terminal.visible(b"caf\xc3\xa9 \xff\xfe") == "café \\xff\\xfe"
    assert terminal.visible(b"\xff".decode("utf-8", "surrogateescape")) == "\\xff"
    assert terminal.visible("\ud800") == "<U+D800>"
    assert terminal.visible(17) == "17"


@pytest.mark.parametrize("text", MARKUP)
def test_markup_is_shown_literally(text):
    rendered = Text.from_markup(terminal.markup(text), emoji=False)
    assert rendered.plain == text
    assert Text.from_markup(f"[red]{terminal.markup(text)}[/red] [b]ok[/b]").plain == text + " ok"
    assert not [s for s in rendered.spans if s.end > s.start]  # no style, no link


def test_raw_markup_would_render_or_crash():
    # Why the escaping matters: the same strings unescaped are markup.
    with pytest.raises(MarkupError):
        Text.from_markup("[/]")
    assert Text.from_markup("[link=file:///etc/passwd]x[/link]").plain == "x"


def test_console_prints_exactly_the_visible_text():
    out = io.StringIO()
    con = terminal.console(file=out, width=400, force_terminal=False)
    hostile = b"\x1b]0;t\x07[bold]:smile: 12 [/] \xff"
    con.print(terminal.markup(hostile))
    assert out.getvalue() == terminal.visible(hostile) + "\n"


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200)))
def test_no_control_character_survives(data):
    shown = terminal.visible(data)
    # Cc: C0, DEL, C1; Cs: lone surrogates (unwritable); plus the characters that reorder a line.
    assert not [ch for ch in shown if ch != "\t" and unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp")]
    assert not set(shown) & set(terminal._REORDERING)
    shown.encode("utf-8")  # always writable to a UTF-8 terminal


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200),
                 st.lists(st.sampled_from(["[", "]", "/", "\\", "link=", "bold", "@", "#", "x", ":", "\x1b"]),
                          max_size=30).map("".join)))
def test_rich_renders_exactly_the_visible_text(data):
    for newlines in (False, True):
        rendered = Text.from_markup(terminal.markup(data, newlines), emoji=False)
        assert rendered.plain == terminal.visible(data, newlines)
        assert not [s for s in rendered.spans if s.end > s.start]
        in_template = Text.from_markup(f"[red]{terminal.markup(data, newlines)}[/red]", emoji=False)
        assert in_template.plain == rendered.plain


def test_eval_lines_and_results_are_shown_visibly():
    from dflash_ops import payload

    shown = []
    stream = payload.ShowLines(shown.append)
    stream.write("loading /root/runs/r\x1b]0;TITLE\x07/config.yaml\nRESULT {}\n[/] done\n")
    assert shown == ["loading /root/runs/r^[]0;TITLE^G/config.yaml", "[/] done"]

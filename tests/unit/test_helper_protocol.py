"""The one helper protocol: every shipped helper, run as the container runs it (the prelude and the
helper's text through the loader, the system python with -S), answers every verb's bad input in the
same shape, one line of {"error": kind, "message": text}; and `ship.answer` reads every reply."""

import json
import subprocess
import sys

import pytest

from dflash_ops.errors import DflashOpsError
from dflash_ops.remote import facts, fetch, history, release, runs, ship

MODULES = {"runs": runs, "facts": facts, "fetch": fetch, "history": history, "release": release}
KEYS = ("runs", "name", "want", "code", "venv", "model", "caches", "run", "checkpoint", "names", "argv",
        "config", "releases", "tarball", "release", "tree", "keep", "offset", "timeout", "lines", "grace",
        "older_than", "act", "part", "dest", "size", "sha256", "requirements", "want", "python", "script",
        "out", "cwd", "fit_steps")
BAD = ["nope", "[1]", "null", json.dumps({key: [7] for key in KEYS})]


def shipped(helper, *args):
    """The helper's reply as the container prints it: (exit code, stdout lines, stderr)."""
    out = subprocess.run([sys.executable, "-S", "-c", ship.LOADER, ship.packed(helper), *args],
                         capture_output=True, text=True, timeout=60)
    return out.returncode, out.stdout.splitlines(), out.stderr


CASES = [(helper, verb, bad) for helper, module in MODULES.items() for verb in module.VERBS for bad in BAD]


@pytest.mark.parametrize(("helper", "verb", "bad"), CASES)
def test_every_verb_of_every_helper_refuses_bad_input_in_the_one_shape(helper, verb, bad):
    code, lines, err = shipped(helper, verb, bad)
    assert code == 0 and err == "", err
    assert len(lines) == 1
    answer = json.loads(lines[0])
    assert set(answer) == {"error", "message"}, answer
    assert answer["error"] in ("usage", "bad-input") and isinstance(answer["message"], str)
    with pytest.raises(ship.Refusal) as refused:
        ship.answer(lines[0] + "\n", "pve1/200: t")
    assert refused.value.kind == answer["error"] and "\n" not in str(refused.value)


@pytest.mark.parametrize("helper", sorted(MODULES))
def test_an_unknown_verb_or_a_missing_argument_is_a_usage_refusal(helper):
    for args in (["no-such-verb", "{}"], [], [next(iter(MODULES[helper].VERBS))]):
        code, lines, err = shipped(helper, *args)
        assert code == 0 and err == "" and json.loads(lines[-1])["error"] == "usage"


@pytest.mark.parametrize("reply", ["", "\n", "garbage\n", "[1, 2]\n", '{"ok"\n', '{"result": 1}\n',
                                   '{"error": 5}\n', "x" * 100 + "\n", '{"ok": 1}' + "\n" + "y" * 10])
def test_answer_is_the_one_reader_and_a_bad_reply_is_one_line_naming_the_container(reply):
    with pytest.raises(DflashOpsError) as caught:
        ship.answer(reply, "pve1/200: status")
    assert str(caught.value).startswith("pve1/200: status: ") and "\n" not in str(caught.value)
    assert isinstance(caught.value, ship.BadAnswer)


def test_answer_reads_the_last_line_and_refuses_past_its_cap_before_parsing():
    assert ship.answer('{"line": "a"}\n{"ok": {"x": 1}}\r\n', "t") == {"x": 1}
    with pytest.raises(ship.BadAnswer, match="larger than 100 bytes"):
        ship.answer('{"ok": "' + "x" * 200 + '"}\n', "t", cap=100)
    with pytest.raises(ship.Refusal) as refused:
        ship.answer('{"error": "no-run", "message": "no run \\u001b[31m yet", "run": "r"}\n', "t")
    assert (refused.value.kind, refused.value.extra) == ("no-run", {"run": "r"})
    assert "\x1b" not in str(refused.value)


def test_the_shipped_text_is_the_prelude_then_the_helper_without_its_import():
    text = ship.source("history")
    assert text.startswith(open(ship.HERE / "prelude.py").read())
    assert "from dflash_ops" not in text
    assert text.count("def run_state(") == 1 and text.count("def runs_lock(") == 1

"""Exact host command lines for hostile argv/env/cwd values, and their round trip through a real shell."""

import shlex
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_ops import commands
from dflash_ops.errors import UnsafeValue

# (argv, env, cwd) -> the exact line the host's shell receives.
CASES = [
    (["true"], None, None,
     "pct exec 200 -- env -i -- true"),
    (["python3", "-c", "print(1)"], {"A": "x y"}, "/root/my dir",
     "pct exec 200 -- env -i -C '/root/my dir' -- 'A=x y' python3 -c 'print(1)'"),
    (["echo", "it's"], {"Q": 'say "hi"'}, None,
     "pct exec 200 -- env -i -- 'Q=say \"hi\"' echo 'it'\"'\"'s'"),
    (["echo", "$(id)", "`id`"], {"S": "$(reboot)"}, None,
     "pct exec 200 -- env -i -- 'S=$(reboot)' echo '$(id)' '`id`'"),
    (["echo", "a;b", "c&&d", "e|f"], None, "/tmp/x;rm -rf /",
     "pct exec 200 -- env -i -C '/tmp/x;rm -rf /' -- echo 'a;b' 'c&&d' 'e|f'"),
    (["printf", "%s", "line1\nline2"], {"N": "a\nb"}, None,
     "pct exec 200 -- env -i -- 'N=a\nb' printf %s 'line1\nline2'"),
    (["echo", "héllo wörld", "日本"], {"U": "ünï"}, "/root/données",
     "pct exec 200 -- env -i -C '/root/données' -- 'U=ünï' echo 'héllo wörld' '日本'"),
    (["echo", "", "-n", "--"], {"EMPTY": ""}, None,
     "pct exec 200 -- env -i -- EMPTY= echo '' -n --"),
    (["echo", "*", "~", "{a,b}", "!x"], None, None,
     "pct exec 200 -- env -i -- echo '*' '~' '{a,b}' '!x'"),
]


@pytest.mark.parametrize("argv,env,cwd,expected", CASES)
def test_exact_pct_exec_lines(argv, env, cwd, expected):
    assert commands.pct_exec(200, argv, env=env, cwd=cwd) == expected


def test_pct_path_is_quoted_too():
    line = commands.pct_exec(201, ["true"], pct="/opt/my pct/pct")
    assert line == "'/opt/my pct/pct' exec 201 -- env -i -- true"


@pytest.mark.parametrize("bad", ["a\x00b", "bad\udcff"])
def test_unsafe_values_are_refused(bad):
    with pytest.raises(UnsafeValue):
        commands.pct_exec(200, ["echo", bad])
    with pytest.raises(UnsafeValue):
        commands.pct_exec(200, ["echo"], env={"X": bad})
    with pytest.raises(UnsafeValue):
        commands.pct_exec(200, ["echo"], cwd=bad)


@pytest.mark.parametrize("name", ["1X", "A-B", "A B", "A=B", "", "X;rm"])
def test_malformed_env_names_are_refused(name):
    with pytest.raises(UnsafeValue):
        commands.pct_exec(200, ["true"], env={name: "v"})


def test_program_name_with_equals_is_refused():
    # env(1) would take it as one more assignment and run the next word instead.
    with pytest.raises(UnsafeValue):
        commands.pct_exec(200, ["X=1", "rm"])


@pytest.mark.parametrize("ctid", ["200", True, 200.0, None])
def test_container_id_must_be_an_int(ctid):
    with pytest.raises(UnsafeValue):
        commands.pct_exec(ctid, ["true"])


def test_sh_script_passes_values_as_positional_arguments():
    argv = commands.sh_script('printf "%s" "$1" > "$2"', "$(id)", "/tmp/a b")
    assert argv == ["sh", "-c", 'printf "%s" "$1" > "$2"', "sh", "$(id)", "/tmp/a b"]


def test_mask_hides_raw_and_quoted_secrets():
    line = commands.pct_exec(200, ["run"], env={"HF_TOKEN": "hf_s3cr3t value"})
    shown = commands.mask(line, ["hf_s3cr3t value"])
    assert "s3cr3t" not in shown and commands.MASK in shown


HOSTILE = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                  max_size=40)


@settings(max_examples=60, deadline=None)
@given(args=st.lists(HOSTILE, min_size=1, max_size=4), value=HOSTILE, cwd=HOSTILE)
def test_a_real_shell_reads_back_exactly_what_was_built(args, value, cwd):
    """Property: the host's shell parses the line back into pct's argv, value for value."""
    line = commands.pct_exec(200, ["prog", *args], env={"V": value}, cwd="/" + cwd)
    # Replace `pct` by a program that prints its argv NUL-separated; run the line in real bash.
    out = subprocess.run(["bash", "-c", "pct() { printf '%s\\0' \"$@\"; }; " + line],
                         capture_output=True, check=True).stdout
    got = out.decode("utf-8").split("\x00")[:-1]
    assert got == ["exec", "200", "--", "env", "-i", "-C", "/" + cwd, "--", f"V={value}", "prog", *args]
    assert shlex.split(line)[0] == "pct"

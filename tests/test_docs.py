"""The docs cannot rot: every command of docs/tutorial.md runs, in order.

Convention (stated at the top of the tutorial):

- only fenced ```sh blocks are commands; output is shown in ```text blocks;
- a command line is ``trajstore ...`` or ``python -m trajstore.examples.<name> ...``, optionally
  preceded by ``VAR=value`` assignments, or ``export VAR=value ...``;
- ``$VAR`` / ``${VAR}`` are expanded from the variables exported so far; the
  first ``export WORK=...`` is replaced by a fresh temporary directory;
- a trailing ``# exit N`` is the expected exit code (default 0);
- a trailing ``# not run by tests/test_docs.py: see tests/test_api.py`` marks
  the lines (``trajstore serve``, ``curl``) that cannot run in sequence.

Every other line must be one of those forms, so a new command in the
tutorial is either run here or the test fails.

Shown output: a ```text block shows the output of the ```sh block before it.
Its lines that carry a verdict, a count or a stage (``CHECKED``) must appear,
in the same order, in what that block's commands really print, compared after
``normalise`` (the temporary $WORK shown as /tmp/trajstore-tutorial, times,
decimal numbers and the values of ``expected=``/``a=``-style fields masked,
the store's object counts masked, runs of blanks collapsed). Other integers
(bundles, samples, tokens, mismatches, token offsets) and every word are
compared as they are. Object counts are masked because the MoE section's
routes come from float math on the CPU at hand, and they decide how many
distinct chunks the store holds.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from trajstore.capture.config import ENV_VARS
from trajstore.cli import build_parser

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TUTORIAL = DOCS / "tutorial.md"
NOT_RUN = "# not run by tests/test_docs.py: see tests/test_api.py"

_FENCE = re.compile(r"^```(\w*)\s*$")
_EXIT = re.compile(r"#\s*exit\s+(\d+)\s*$")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass
class Line:
    lineno: int
    text: str  # the command, comment removed
    expect: int
    skip: bool
    block: int = 0  # which ```sh block (0-based) holds it


#: the path the tutorial shows for $WORK
SHOWN_WORK = "/tmp/trajstore-tutorial"
#: shown output lines that carry a verdict, a count or a stage: these are checked
CHECKED = re.compile(
    "|".join(
        (
            r"^bundle \S+ — ",  # a replay's verdict
            r"^\[ *(pass|fail|skipped)\] ",  # a stage's verdict
            r"first divergent stage",
            r"\b(sample|reward\.raw|reward\.post_process|advantage\.kl|advantage\.estimate"
            r"|loss\.policy|loss\.value|router\.consistency)\b",  # table rows naming a stage
            r"\b(pass|diverged|unsupported|refused)\b",  # verdict columns
            r"^ +\S+ \S+: expected=",  # a divergence: field, sample, @token offset
            r"^ *selection: \d+ sample",
            r"^replayed \d+ of \d+ bundle",
            r"^capture: written=",
            r"^wrote \d+ bundles",
            r": valid$",
            r"^(published|removed|exported) ",
            r"bundle\(s\) removed",
            r"difference\(s\)$|: identical \(",
            r"^ +\[(identity|samples|config|expected|payload)\] ",  # one diff row
            r"^first differing payload",
            r"^trajstore: error: ",
            r"^\S+ +\d+ +[\d.]+ (B|KiB|MiB|GiB) ",  # stats: bundles per run
            r"^\S+/(step|rollout)-\d+(-\d+)?/a\d+ ",  # ls: a bundle and its sample count
            r"^\w+: \d+ steps into run ",
            r"^ +\w+: steps=\d+ ",  # router stability counts
            r"^checked \d+ objects|^reindexed: |^gc: dropped ",
        )
    )
)
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z?")
_FIELD_VALUE = re.compile(r"\b(expected|actual|abs_err|max_abs_error|a|b)=[^ )]+")
_OBJECTS = re.compile(r"\b\d+ (live )?objects\b")
_DECIMAL = re.compile(r"-?\d+\.\d+(e[-+]?\d+)?|-?\d+e[-+]?\d+")


def normalise(line: str, work: str = SHOWN_WORK) -> str:
    """A shown or a real output line with what legitimately varies masked."""
    line = line.replace(work, SHOWN_WORK)
    line = _TIME.sub("<time>", line)
    line = _FIELD_VALUE.sub(lambda m: f"{m.group(1)}=<v>", line)
    line = _OBJECTS.sub(lambda m: f"<n> {m.group(1) or ''}objects", line)
    line = _DECIMAL.sub("<num>", line)
    return " ".join(line.split())


def sh_lines(markdown: str) -> list[Line]:
    """The command lines of every ```sh block, with continuations joined."""
    out: list[Line] = []
    in_sh = False
    in_block = False
    block = -1
    pending = ""
    start = 0
    for n, raw in enumerate(markdown.splitlines(), 1):
        m = _FENCE.match(raw.strip())
        if m:
            if in_block:
                assert not pending, (
                    f"tutorial.md:{start}: continuation runs past the end of the block"
                )
                in_sh = in_block = False
            else:
                in_block = True
                in_sh = m.group(1) == "sh"
                block += in_sh
            continue
        if not in_sh:
            continue
        line = raw.rstrip()
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if not line.strip() or line.strip().startswith("#"):
            continue
        skip = line.rstrip().endswith(NOT_RUN)
        expect = 0
        code = line
        if skip:
            code = line[: line.rindex(NOT_RUN)]
        else:
            em = _EXIT.search(line)
            if em:
                expect = int(em.group(1))
                code = line[: em.start()]
        assert "#" not in code.replace("'#", "").replace('"#', ""), (
            f"tutorial.md:{start}: only '# exit N' or the not-run marker may trail a command: "
            f"{line!r}"
        )
        out.append(Line(start, code.strip(), expect, skip, block))
    assert not in_sh, "tutorial.md: unterminated ```sh block"
    return out


def shown_outputs(markdown: str) -> dict[int, tuple[int, list[str]]]:
    """sh block index -> (line number, lines) of the ```text block that shows its output."""
    shown: dict[int, tuple[int, list[str]]] = {}
    block = -1
    kind: str | None = None
    body: list[str] = []
    start = 0
    for n, raw in enumerate(markdown.splitlines(), 1):
        m = _FENCE.match(raw.strip())
        if m and kind is None:
            kind, body, start = m.group(1), [], n
            block += kind == "sh"
        elif m:
            if kind == "text" and block >= 0:
                assert block not in shown, (
                    f"tutorial.md:{start}: a second text block for one sh block"
                )
                shown[block] = (start, body)
            kind = None
        elif kind is not None:
            body.append(raw)
    return shown


def expand(word: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in env, f"${name} is used before it is exported in the tutorial"
        return env[name]

    return _VAR.sub(sub, word)


def to_argv(line: Line, env: dict[str, str]) -> tuple[list[str], dict[str, str]] | None:
    """argv and extra environment of a runnable line; None for `export`."""
    words = shlex.split(line.text)
    if words[0] == "export":
        for word in words[1:]:
            assignment = _ASSIGN.match(word)
            assert assignment, f"tutorial.md:{line.lineno}: export needs VAR=value, got {word!r}"
            name, value = assignment.groups()
            if name == "WORK" and not env.get("_WORK_SEEN"):
                env["_WORK_SEEN"] = "1"  # the first WORK is the test's own temporary directory
                continue
            env[name] = expand(value, env)
        return None
    extra: dict[str, str] = {}
    while words and _ASSIGN.match(words[0]):
        name, value = _ASSIGN.match(words[0]).groups()
        extra[name] = expand(value, env)
        words.pop(0)
    words = [expand(word, env) for word in words]
    if words[0] == "trajstore":
        argv = [sys.executable, "-m", "trajstore", *words[1:]]
    elif (
        words[:2] == ["python", "-m"] and words[2:3] and words[2].startswith("trajstore.examples.")
    ):
        argv = [sys.executable, *words[1:]]
    else:
        raise AssertionError(
            f"tutorial.md:{line.lineno}: {line.text!r} is neither `trajstore ...` nor "
            "`python -m trajstore.examples.<name> ...`; "
            f"run it here or mark it {NOT_RUN!r}"
        )
    return argv, extra


@dataclass
class Ran:
    line: Line
    returncode: int
    output: str  # stdout, then stderr


def run_tutorial(work: Path, echo: bool = False) -> list[Ran]:
    """Run every command of the tutorial in order, checking each exit code."""
    lines = sh_lines(TUTORIAL.read_text(encoding="utf-8"))
    env = {"WORK": str(work)}
    work.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    base["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    base["COLUMNS"] = "200"
    done: list[Ran] = []
    for line in lines:
        if line.skip:
            continue
        got = to_argv(line, env)
        if got is None:
            continue
        argv, extra = got
        proc = subprocess.run(
            argv,
            cwd=ROOT,
            env={**base, **env, **extra},
            capture_output=True,
            text=True,
            timeout=300,
        )
        if echo:
            print(
                f"$ {line.text}    # rc={proc.returncode}\n{proc.stdout}{proc.stderr}", flush=True
            )
        assert proc.returncode == line.expect, (
            f"tutorial.md:{line.lineno}: {line.text!r} exited {proc.returncode}, the tutorial says "
            f"{line.expect}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        )
        done.append(Ran(line, proc.returncode, proc.stdout + proc.stderr))
    return done


@pytest.fixture(scope="module")
def tutorial_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Ran]]:
    """The tutorial, run once for the tests below: ($WORK, every command run)."""
    work = tmp_path_factory.mktemp("tutorial") / "work"
    return work, run_tutorial(work)


def test_tutorial_commands_run_in_order(tutorial_run: tuple[Path, list[Ran]]) -> None:
    lines = sh_lines(TUTORIAL.read_text(encoding="utf-8"))
    skipped = [ln for ln in lines if ln.skip]
    # exactly the server and curl lines are skipped
    for ln in skipped:
        assert ln.text.startswith(("trajstore serve", "curl ")), (
            f"tutorial.md:{ln.lineno}: only `trajstore serve` and `curl` may be marked not-run: "
            f"{ln.text!r}"
        )
    assert any(ln.text.startswith("trajstore serve") for ln in skipped)
    assert any(ln.text.startswith("curl ") for ln in skipped)
    for ln in lines:
        if ln.text.startswith(("trajstore serve", "curl ")):
            assert ln.skip, (
                f"tutorial.md:{ln.lineno}: {ln.text!r} cannot run in sequence; mark it {NOT_RUN!r}"
            )
    _, done = tutorial_run
    runnable = [ln for ln in lines if not ln.skip and not ln.text.startswith("export ")]
    assert [r.line.lineno for r in done] == [ln.lineno for ln in runnable]
    assert len(done) >= 25
    # the tutorial shows every kind of exit
    assert {r.returncode for r in done} == {0, 1, 2}


def check_shown(doc_lines: list[str], real: list[str]) -> tuple[int, str | None]:
    """(lines checked, the first CHECKED doc line missing from `real` in order, or None).

    `real` is already normalised.
    """
    at = checked = 0
    for doc_line in doc_lines:
        if not CHECKED.search(doc_line):
            continue
        want = normalise(doc_line)
        found = next((i for i in range(at, len(real)) if real[i] == want), None)
        if found is None:
            return checked, doc_line
        at = found + 1
        checked += 1
    return checked, None


def test_tutorial_shows_the_real_verdicts_counts_and_stages(
    tutorial_run: tuple[Path, list[Ran]],
) -> None:
    work, done = tutorial_run
    shown = shown_outputs(TUTORIAL.read_text(encoding="utf-8"))
    total = 0
    for block, (lineno, doc_lines) in sorted(shown.items()):
        ran = [r for r in done if r.line.block == block]
        if not ran:  # the server's block: curl is not run here
            continue
        real = [normalise(x, str(work)) for r in ran for x in r.output.splitlines()]
        checked, missing = check_shown(doc_lines, real)
        assert missing is None, (
            f"tutorial.md:{lineno}: shown line {missing.strip()!r} is not in the real output "
            f"(in this order); normalised: {normalise(missing)!r}\n--- real output, normalised\n"
            + "\n".join(real)[-4000:]
        )
        total += checked
    assert total >= 100  # the verdict, count and stage lines of every section


def test_a_wrong_count_or_stage_in_a_shown_line_is_caught() -> None:
    real = [
        normalise(x)
        for x in (
            "replayed 18 of 18 bundle(s) in 0.6 s (0 already recorded): 14 pass, 4 diverged",
            "first divergent stage:",
            "  loss.policy            1",
            "  reward.post_process    3",
        )
    ]
    doc = [
        "replayed 18 of 18 bundle(s) in 0.571 s (0 already recorded): 14 pass, 4 diverged",
        "...",
    ]
    assert check_shown(
        doc + ["first divergent stage:", "  loss.policy  1", "  reward.post_process 3"], real
    ) == (4, None)
    wrong = "replayed 18 of 18 bundle(s) in 1.0 s (0 already recorded): 13 pass, 5 diverged"
    assert check_shown([wrong], real) == (0, wrong)
    assert (
        check_shown(["first divergent stage:", "  advantage.estimate 3"], real)[1]
        == "  advantage.estimate 3"
    )
    # order matters: a line shown before another must be printed before it
    assert check_shown(["  reward.post_process 3", "  loss.policy 1"], real)[1] == "  loss.policy 1"


def test_checked_lines_and_normalisation() -> None:
    for line in (
        "bundle replay-3-0 — first divergent stage: reward.post_process",
        "[skipped] loss.value — unsupported: value loss is not replayable (GRPO has no critic)",
        "replayed 18 of 18 bundle(s) in 0.571 s (0 already recorded): 14 pass, 4 diverged",
        "          advantages r3-s16@1: expected=-0.465129 actual=-0.353552 abs_err=0.111577",
        "long  3  0  1  []  diverged  reward.post_process  null  long/rollout-3/a1  "
        "2026-11-30T00:40:55.8Z",
    ):
        assert CHECKED.search(line), line
    for line in (
        "  payload entropy   torch.float32   [3948]   17321 B",
        "...",
        "  layer 0   0.007812",
    ):
        assert not CHECKED.search(line), line
    assert (
        normalise(
            "  advantages r3-s16@1: expected=-0.465129 actual=-0.35 abs_err=1e-07 in 0.571 s at "
            "2026-11-30T00:40:55Z"
        )
        == "advantages r3-s16@1: expected=<v> actual=<v> abs_err=<v> in <num> s at <time>"
    )
    assert (
        normalise("/w/x/capture/replay-0-0: valid", "/w/x")
        == "/tmp/trajstore-tutorial/capture/replay-0-0: valid"
    )
    assert normalise("gc: dropped 217 objects (1773 live objects kept)") == (
        "gc: dropped <n> objects (<n> live objects kept)"
    )
    # other integers (counts, offsets) are compared as they are
    assert normalise("16 sample(s) r3-s16@0") == "16 sample(s) r3-s16@0"


def test_tutorial_parser() -> None:
    md = "\n".join(
        [
            "```sh",
            "export WORK=/tmp/x A=$WORK/a",
            "trajstore replay $A \\",
            "    --step 1:0   # exit 1",
            "TRAJSTORE_RUN=r python -m trajstore.examples.tiny_grpo --from-env",
            f"curl -s localhost:8000/v1/health   {NOT_RUN}",
            "```",
            "```text",
            "trajstore not-a-command",
            "```",
        ]
    )
    lines = sh_lines(md)
    assert [(ln.text.split()[0], ln.expect, ln.skip) for ln in lines] == [
        ("export", 0, False),
        ("trajstore", 1, False),
        ("TRAJSTORE_RUN=r", 0, False),
        ("curl", 0, True),
    ]
    env = {"WORK": "/w"}
    assert to_argv(lines[0], env) is None and env["A"] == "/w/a" and env["WORK"] == "/w"
    argv, extra = to_argv(lines[1], env)
    assert argv[:3] == [sys.executable, "-m", "trajstore"] and argv[3:] == [
        "replay",
        "/w/a",
        "--step",
        "1:0",
    ]
    argv, extra = to_argv(lines[2], env)
    assert argv == [
        sys.executable,
        "-m",
        "trajstore.examples.tiny_grpo",
        "--from-env",
    ] and extra == {"TRAJSTORE_RUN": "r"}


def _help_commands(*cmd: str) -> list[str]:
    """The subcommands that `trajstore [CMD] --help` lists."""
    out = subprocess.run(
        [sys.executable, "-m", "trajstore", *cmd, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    block = out.split("positional arguments:", 1)[1].split("options:", 1)[0]
    names = re.findall(r"^ {4}([a-z][a-z0-9_-]*)(?: {2,}|$)", block, re.M)
    assert names, out
    return names


def test_cli_reference_lists_every_subcommand() -> None:
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    commands = _help_commands()
    assert {"inspect", "validate", "replay", "ingest", "query", "sql", "serve", "router"} <= set(
        commands
    )
    for cmd in commands:
        assert re.search(rf"^#+ .*`trajstore {cmd}\b", text, re.M), (
            f"docs/cli.md has no section for `trajstore {cmd}`"
        )
    subs = _help_commands("router")
    assert set(subs) == {"metrics", "compare"}
    for sub in subs:
        assert re.search(rf"^#+ .*`trajstore router {sub}\b", text, re.M), (
            f"docs/cli.md: no section for `trajstore router {sub}`"
        )


def _leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from _leaf_parsers(child, (*path, name))


def test_cli_reference_lists_every_flag() -> None:
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    missing = []
    leaves = list(_leaf_parsers(build_parser()))
    assert len(leaves) >= 17
    for path, parser in leaves:
        for action in parser._actions:
            for flag in action.option_strings:
                if (
                    flag.startswith("--")
                    and flag != "--help"
                    and f"`{flag}" not in text
                    and f" {flag}" not in text
                ):
                    missing.append(f"trajstore {' '.join(path)} {flag}")
    assert not missing, f"docs/cli.md does not mention: {missing}"


def test_cli_reference_lists_env_vars_and_exit_codes() -> None:
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    for var in (
        "TRAJSTORE_STORE",
        "TRAJSTORE_API_TOKEN",
        "TRAJSTORE_DEBUG",
        *sorted({name for names in ENV_VARS.values() for name in names}),
    ):
        assert f"`{var}`" in text, f"docs/cli.md does not document {var}"
    for code in ("`0`", "`1`", "`2`"):
        assert code in text


def test_docs_index_lists_every_page() -> None:
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "README.md":
            assert f"({page.name})" in index, f"docs/README.md does not link {page.name}"


def test_relative_links_resolve() -> None:
    for page in ("tutorial.md", "cli.md", "bundle-format.md", "README.md"):
        text = (DOCS / page).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (DOCS / target).resolve().exists(), f"docs/{page}: broken link {target}"


if __name__ == "__main__":  # print every command's real output (to refresh the tutorial)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run_tutorial(Path(tmp) / "work", echo=True)

"""Every fenced example in README.md and docs/ runs as printed (docs/contributing.md has the
conventions): YAML configs pass `corral check`, shell and Python examples run against one real
corral serving the demo model, with their shown output compared, the usage synopsis lists what
`corral --help` offers, and a block that cannot run in a test says why (listed by
test_blocks_not_run_say_why)."""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from corral.supervisor import demo

from conftest import REPO, SMOL, Corral, CorralFactory, declared

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BIN = Path(sys.executable).parent
# `<!-- name -->` or `<!-- name: value -->`, alone on a line.
MARKER = re.compile(r"^<!--\s*([a-z-]+)\s*(?::\s*(.*?))?\s*-->$")
FENCE = re.compile(r"^(`{3,})([\w-]*)\s*$")
RUNNABLE = {"yaml", "sh", "python"}
# The error object of an OpenAI-shaped answer: an example whose output is not shown must not
# print one.
ERROR_OBJECT = re.compile(r'"error":\s*\{')
# The address examples write; the test's daemon listens elsewhere.
ADDRESSES = ("127.0.0.1:8080", "localhost:8080")
# Codex CLI and Claude Code as `make agents` installs them (the docs' coding-agent examples).
AGENTS = REPO / "build" / "agents" / "node_modules" / ".bin"


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    markers: dict[str, str] = field(default_factory=dict)
    output: Block | None = None  # the `output` block that follows it

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The page's fenced blocks, each with the markers right above it; an `output` block is
    attached to the block before it."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        ticks, lang = opening.groups()
        markers: dict[str, str] = {}
        j = i - 1
        while j >= 0 and (marker := MARKER.match(lines[j].strip())):
            markers.setdefault(marker.group(1), marker.group(2) or "")
            j -= 1
        end = i + 1
        while end < len(lines) and not (lines[end].startswith(ticks)
                                        and lines[end].strip("`") == ""):
            end += 1
        assert end < len(lines), f"{page}:{i + 1}: fence never closed"
        block = Block(page, i + 1, lang, "\n".join(lines[i + 1:end]) + "\n", markers)
        if "output" in markers:
            assert found and found[-1].output is None and found[-1].lang in ("sh", "python"), (
                f"{block.id}: an output block must follow the sh or python block it shows")
            found[-1].output = block
        else:
            found.append(block)
        i = end + 1
    return found


BLOCKS = [block for page in PAGES for block in blocks_of(page)]
# What cannot run here (a GPU box, root's systemd) is not a case that skips: it is listed, with
# its reason, by test_blocks_not_run_say_why, and every other block is a case that runs.
RUNNABLE = [block for block in BLOCKS if "not-run" not in block.markers]


def test_the_pages_have_examples() -> None:
    """The extraction itself: a regression that finds nothing would pass every case below."""
    assert len(BLOCKS) > 40 and len(RUNNABLE) > 30, (len(BLOCKS), len(RUNNABLE))
    assert {b.lang for b in RUNNABLE} >= {"yaml", "sh", "python", "text"}


def test_blocks_not_run_say_why() -> None:
    """The few blocks no test can run each carry their reason, and stay few."""
    not_run = [b for b in BLOCKS if "not-run" in b.markers]
    assert all(b.markers["not-run"] for b in not_run), [b.id for b in not_run]
    assert len(not_run) <= len(BLOCKS) // 4, [f"{b.id}: {b.markers['not-run']}" for b in not_run]


# -- the daemon the sh and python examples talk to ------------------------------------------------

@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that looks like a checkout (links to its top-level entries) where examples
    run and write their files."""
    folder = tmp_path_factory.mktemp("checkout")
    for entry in REPO.iterdir():
        if not entry.name.startswith(".") and entry.name != "build":
            (folder / entry.name).symlink_to(entry)
    # The venv these tests run in, where a checkout has it (`source .venv/bin/activate`).
    (folder / ".venv").symlink_to(Path(sys.prefix))
    return folder


@pytest.fixture(scope="module")
def docs_factory(scratch: Path, request: pytest.FixtureRequest) -> Iterator[CorralFactory]:
    """The module's daemons (the examples' corral and the `serve` examples), started in the
    scratch checkout; closed at the module's end, which fails on orphans and on log lines
    nobody declared."""
    factory = CorralFactory(scratch, declared(request))
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def docs_corral(docs_factory: CorralFactory, smol_model: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Corral:
    """presets/groups.yaml, plus the demo model under its file name with the request profile
    `make run` gives it (the embedded default's)."""
    config = {"include": str(REPO / "presets" / "groups.yaml"),
              "models": {demo.NAME: {"model": str(smol_model),
                                     "request": demo.REQUEST.model_dump(exclude_defaults=True)}}}
    path = tmp_path_factory.mktemp("docs-config") / "docs.yaml"
    path.write_text(yaml.safe_dump(config))
    return docs_factory.serve(path)


def environment(block: Block, corral: Corral | None = None) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{BIN}:{AGENTS}:{os.environ.get('PATH', '')}"}
    if corral is not None:
        # What a reader's `corral ps` finds by default (127.0.0.1:8080) is this daemon here.
        env["CORRAL_URL"] = corral.url
    for pair in shlex.split(block.markers.get("env", "")):
        name, _, value = pair.partition("=")
        env[name] = value
    return env


def aimed_at(text: str, corral: Corral) -> str:
    address = corral.url.removeprefix("http://")
    for printed in ADDRESSES:
        text = text.replace(printed, address)
    return text


def matches(expected: str, actual: str) -> bool:
    """doctest's ELLIPSIS: `...` stands for any text; trailing spaces and blank lines at the
    ends do not count."""
    def tidy(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())
    pattern = ".*?".join(re.escape(part) for part in tidy(expected).split("..."))
    return re.fullmatch(pattern, tidy(actual), re.S) is not None


def shortened(text: str, keep: int = 1500) -> str:
    return text if len(text) <= 2 * keep else f"{text[:keep]}\n[...]\n{text[-keep:]}"


def check_output(block: Block, done: subprocess.CompletedProcess[str]) -> None:
    expected_code = int(block.markers.get("exit", "0"))
    printed = shortened(done.stdout + done.stderr)
    assert done.returncode == expected_code, (
        f"{block.id}: exit code {done.returncode}, not {expected_code}:\n{printed}")
    if block.output is not None:
        assert matches(block.output.text, done.stdout + done.stderr), (
            f"{block.id}: printed\n{printed}\nwhere {block.output.id} shows\n"
            f"{block.output.text}")
    else:
        assert not ERROR_OBJECT.search(done.stdout), f"{block.id}: an error answer:\n{printed}"


# Examples read no stdin: it is closed (`codex exec` takes a piped stdin as more prompt).
def run_shell(block: Block, corral: Corral, cwd: Path) -> None:
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", aimed_at(block.text, corral)],
                          cwd=cwd, env=environment(block, corral), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=240)
    check_output(block, done)


def run_python(block: Block, corral: Corral, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-c", aimed_at(block.text, corral)], cwd=cwd,
                          env=environment(block, corral), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=240)
    check_output(block, done)


def run_serve(block: Block, factory: CorralFactory) -> None:
    """`corral serve ...` as printed (its --listen aside): it must come up healthy, and stop
    cleanly on SIGTERM (the factory checks its log and its children at the module's end)."""
    lines = [line for line in block.text.splitlines() if line.strip()]
    assert len(lines) == 1, f"{block.id}: a serve block is one command"
    argv = shlex.split(lines[0])
    assert argv[:2] == ["corral", "serve"], f"{block.id}: not a corral serve command"
    config = next((Path(argv[i + 1]) for i, a in enumerate(argv) if a in ("-c", "--config")),
                  factory.folder / "none.yaml")
    served = factory.spawn(argv[2:], factory.folder / config)
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(60) == 0, f"{block.id}: corral serve did not stop cleanly"


# -- configs ---------------------------------------------------------------------------------

def wrapped(block: Block) -> str:
    """A `fragment: a.b` block placed under that key path, indented, comments and all."""
    path = block.markers.get("fragment")
    if not path:
        return block.text
    keys = path.split(".")
    head = "".join("  " * depth + f"{key}:\n" for depth, key in enumerate(keys))
    indent = "  " * len(keys)
    return head + "".join(indent + line if line.strip() else line
                          for line in block.text.splitlines(keepends=True))


def strings(node: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """(key, value) for every string in a parsed config."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from strings(v, str(k))
    elif isinstance(node, list):
        for v in node:
            yield from strings(v, key)
    elif isinstance(node, str):
        yield key, node


def provide_files(text: str, folder: Path) -> None:
    """What a reader's config names, beside it: model files (links to the demo model),
    models folders, and a plugin strategy's file from presets/contrib/."""
    for key, value in strings(yaml.safe_load(text)):
        if "${" in value or value.startswith("/"):
            continue
        if value.endswith(".gguf"):
            target = folder / value
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to(SMOL)
        elif key == "models_dir":
            (folder / value).mkdir(parents=True, exist_ok=True)
        elif value.startswith("plugin:") and ".py:" in value:
            source = value.removeprefix("plugin:").rsplit(":", 1)[0]
            target = folder / source
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / "presets" / "contrib" / Path(source).name, target)


def check_config(block: Block, folder: Path) -> None:
    text = wrapped(block)
    config = folder / "corral.yaml"
    config.write_text(text)
    provide_files(text, folder)
    # A config for another machine (its /opt venv, a GPU box's files) is checked in all but
    # the files it names, as `corral check --no-files` checks it for its reader.
    files = ["--no-files"] if "no-files" in block.markers else []
    done = subprocess.run(["corral", "check", *files, str(config)], capture_output=True,
                          text=True, env=environment(block), cwd=folder, timeout=120)
    assert done.returncode == 0 and ": ok (" in done.stdout, (
        f"{block.id}: corral check failed:\n{done.stdout}{done.stderr}\n--- the config:\n{text}")


def check_prometheus_config(block: Block, folder: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: `make system-deps` installs Debian's prometheus"
    config = folder / "prometheus.yml"
    config.write_text(block.text)
    done = subprocess.run([promtool, "check", "config", str(config)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, f"{block.id}:\n{done.stdout}{done.stderr}"


# -- the usage synopsis --------------------------------------------------------------------------

@functools.cache  # two synopses (README's, install.md's) check the same helps
def cli_help(*args: str) -> str:
    done = subprocess.run(["corral", *args, "--help"], capture_output=True, text=True,
                          env=environment(Block(REPO, 0, "", "")), timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def options_of(help_text: str) -> list[list[str]]:
    """Each option of an argparse help, as its names (`-c`, `--config`); --help left out."""
    found = []
    for line in help_text.splitlines():
        head = re.match(r"^\s{2}(-\S.*?)(?:\s{2,}|$)", line)
        if head:
            names = re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", head.group(1))
            if names and "--help" not in names:
                found.append(names)
    return found


def check_usage(block: Block) -> None:
    """Every subcommand `corral --help` lists, with every option of its own, is in the
    synopsis; a subcommand documented in docs/cli.md may be left to that page."""
    top = cli_help()
    choices = re.search(r"\{([\w,-]+)\}", top)
    assert choices, top
    cli_page = REPO / "docs" / "cli.md"
    elsewhere = cli_page.read_text() if cli_page.exists() else ""
    missing = []
    for sub in choices.group(1).split(","):
        where = block.text if f"corral {sub}" in block.text else elsewhere
        if f"corral {sub}" not in where:
            missing.append(f"corral {sub}")
            continue
        for names in options_of(cli_help(sub)):
            if not any(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", where) for n in names):
                missing.append(f"corral {sub} {'/'.join(names)}")
    assert not missing, f"{block.id}: the synopsis lacks {missing}"


# -- the cases ---------------------------------------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_example(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    markers = block.markers
    if "usage" in markers:
        check_usage(block)
    elif "prometheus-config" in markers:
        check_prometheus_config(block, tmp_path)
    elif block.lang == "yaml":
        check_config(block, tmp_path)
    elif block.lang == "sh" and "serve" in markers:
        run_serve(block, request.getfixturevalue("docs_factory"))
    elif block.lang == "sh":
        corral = request.getfixturevalue("docs_corral")
        run_shell(block, corral, request.getfixturevalue("scratch"))
    elif block.lang == "python":
        corral = request.getfixturevalue("docs_corral")
        run_python(block, corral, request.getfixturevalue("scratch"))
    else:
        pytest.fail(f"{block.id}: a ```{block.lang} block needs a marker (output, usage, "
                    "not-run: reason); see docs/contributing.md")

"""README.md, every docs/*.md page and every examples/*/README.md are executable documentation.

- Every ```python block runs as written, in a namespace of its own, on 4 gloo ranks (the
  blocks call ``ntp.init_mesh`` with tp 2 or 4 and run collectives; one launch for all of
  them), in a scratch directory the ranks share (the HF block writes and reads ``out-dir``).
- Every ```bash command line is read back by what would run it: torchrun's own parser for the
  launcher, ``neuron_tp.cli.entry.main`` for ``neuron-tp`` / ``-m neuron_tp.cli`` (its sub-command
  parsers, with the commands' work replaced by a check of the parsed options: the train,
  generate and serve configs are built), the train / generate parsers for ``scripts/*.py``;
  scripts and files that are named must exist; ``python -c`` code must compile. A multi-rank
  command that is not Neuron-only (``neuron_parallel_compile``, ``compile_and_train.sh``) must
  pass the startup check that refuses several XLA ranks off Neuron (it runs here). A command
  the test does not know how to read fails it, so new kinds of examples get checked too.
  ``k8s/render.sh NAME`` must name a manifest ``k8s/NAME.yaml``. The cluster tools of
  docs/deployment.md (``kubectl``, ``aws``, ``docker``, ``helm``, ``curl``, ``openssl``) run
  against a cluster or a registry, not here: their commands are only split into words. Pipes
  (``|``), ``&&``, ``VAR=value`` lines and ``VAR=$(command)`` are read as the shell would.
- Untagged fences (program output) and the ``layers`` block of docs/architecture.md (read by
  tests/test_architecture.py) are not run.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest

import gloo_dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = (
    ["README.md"]
    + sorted(f"docs/{f}" for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md"))
    + sorted(  # the recipes' pages
        f"examples/{d}/README.md"
        for d in os.listdir(os.path.join(REPO, "examples"))
        if os.path.isfile(os.path.join(REPO, "examples", d, "README.md"))
    )
)


def fenced(kind: str) -> dict[str, str]:
    """The ```kind blocks of every page by ``"<page>:<kind>-L<line of the fence>"``."""
    out = {}
    for page in DOCS:
        with open(os.path.join(REPO, page)) as fh:
            lines = fh.read().splitlines()
        start, opened = None, False
        for i, line in enumerate(lines, 1):
            if not opened and line.strip().startswith("```"):
                opened = True
                if line.strip() == f"```{kind}":
                    start, body = i, []
            elif opened and line.strip() == "```":
                if start is not None:
                    out[f"{page}:{kind}-L{start}"] = "\n".join(body) + "\n"
                opened, start = False, None
            elif start is not None:
                body.append(line)
    return out


PYTHON = fenced("python")


def commands() -> dict[str, list[str]]:
    """Every command of the bash blocks (continuations joined, comments and ``...``
    placeholders dropped) as words, by ``"<page>:L<line>"``."""
    out = {}
    for name, block in fenced("bash").items():
        page, fence = name.split(":")[0], int(name.rsplit("-L", 1)[1])
        lines, i = block.splitlines(), 0
        while i < len(lines):
            start, text = i, lines[i]
            while text.endswith("\\") and i + 1 < len(lines):  # a continuation
                i += 1
                text = text[:-1] + lines[i]
            i += 1
            words = [w for w in shlex.split(text, comments=True) if w != "..."]
            if words:
                out[f"{page}:L{fence + 1 + start}"] = words
    return out


COMMANDS = commands()


# -- python blocks ---------------------------------------------------------------------------


def _run_block(case: str, workdir: str) -> None:
    where = os.path.join(workdir, re.sub(r"[^\w.-]", "_", case))
    os.makedirs(where, exist_ok=True)
    os.chdir(where)
    code = compile(PYTHON[case], case, "exec")
    exec(code, {"__name__": "__readme__"})  # noqa: S102 - the documentation's own example


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("readme"))


def test_readme_has_python_blocks():
    assert any(k.startswith("README.md:") for k in PYTHON), PYTHON.keys()
    assert len(PYTHON) >= 3, PYTHON.keys()


def test_readme_names_the_test_command():
    """CI's ``.ci/run`` calls ``./scripts/test.sh``; the README says it runs everything."""
    with open(os.path.join(REPO, "README.md")) as fh:
        assert "./scripts/test.sh" in fh.read()


@pytest.mark.parametrize("case", sorted(PYTHON))
def test_python_block_runs(case, workdir):
    gloo_dist.run_case(_run_block, case, workdir, cases=sorted(PYTHON), world_size=4)


# -- bash commands ---------------------------------------------------------------------------

SCRIPTS = {"scripts/train.py": "train", "scripts/generate.py": "generate"}


class _Checked(BaseException):
    """Raised by the stand-ins of the commands' work: the options parsed (a BaseException:
    the CLI's own error handling, which turns exceptions into one line, lets it through)."""


def _check_cli(argv: list[str], world: int, neuron_only: bool, monkeypatch) -> None:
    """``neuron-tp ARGV`` parses, and its options make a valid config (that would run here)."""
    import neuron_tp.checkpoint
    import neuron_tp.cli.launch
    import neuron_tp.cli.plan
    import neuron_tp.cli.selftest
    from neuron_tp.cli.entry import main
    from neuron_tp.job.config import GenerateConfig, ServeConfig, TrainConfig
    from neuron_tp.job.runtime import refuse_xla_ranks_off_neuron

    def with_config(kind):
        def check(args):
            kind.from_args(args)
            if not neuron_only:
                monkeypatch.setenv("WORLD_SIZE", str(world))
                refuse_xla_ranks_off_neuron(args.device)
            raise _Checked

        return check

    def plan(rest):
        neuron_tp.cli.plan.plan_parser().parse_args(rest)
        raise _Checked

    def consolidate(checkpoint, out_dir, adapter_only=False):
        raise _Checked

    def consolidate_int8(checkpoint, out_dir):
        raise _Checked

    def selftest(rest):
        st = neuron_tp.cli.selftest
        st.options_from_args(st.selftest_parser().parse_args(rest))
        raise _Checked

    monkeypatch.setattr(neuron_tp.cli.launch, "train_command", with_config(TrainConfig))
    monkeypatch.setattr(neuron_tp.cli.launch, "generate_command", with_config(GenerateConfig))
    monkeypatch.setattr(neuron_tp.cli.launch, "serve_command", with_config(ServeConfig))
    monkeypatch.setattr(neuron_tp.cli.plan, "plan_command", plan)
    monkeypatch.setattr(neuron_tp.cli.selftest, "selftest_command", selftest)
    monkeypatch.setattr(neuron_tp.checkpoint, "consolidate", consolidate)
    monkeypatch.setattr(neuron_tp.checkpoint, "consolidate_int8", consolidate_int8)
    try:
        code = main(argv)
    except _Checked:
        return
    except SystemExit as e:  # argparse refused an option
        raise AssertionError(f"neuron-tp {shlex.join(argv)}: exit {e.code}") from None
    raise AssertionError(f"neuron-tp {shlex.join(argv)}: not run (exit {code})")


def _check_file(path: str, executable: bool = False) -> None:
    full = os.path.join(REPO, path)
    assert os.path.isfile(full), f"{path} does not exist"
    assert not executable or os.access(full, os.X_OK), f"{path} is not executable"


def _check_python(words: list[str], world: int, neuron_only: bool, monkeypatch) -> None:
    """``python ...`` (or a script run by torchrun): ``-c CODE``, ``-m pytest FILES``,
    ``-m neuron_tp.cli``, ``scripts/*.py`` with its options, another repository script."""
    if words[0] == "-c":
        compile(words[1], "python -c", "exec")
    elif words[:2] == ["-m", "pytest"]:
        for w in words[2:]:
            if not w.startswith("-"):
                _check_file(w.split("::")[0])
    elif words[:2] == ["-m", "neuron_tp.cli"]:
        _check_cli(words[2:], world, neuron_only, monkeypatch)
    elif words[0] in SCRIPTS:
        _check_file(words[0])
        _check_cli([SCRIPTS[words[0]], *words[1:]], world, neuron_only, monkeypatch)
    else:
        assert words[0].endswith(".py") and len(words) == 1, f"cannot check python {words}"
        _check_file(words[0])


# run against a cluster or a registry (docs/deployment.md): only split into words here
EXTERNAL = {"kubectl", "aws", "docker", "helm", "curl", "openssl"}


def segments(words: list[str]) -> list[list[str]]:
    """The simple commands of one line: split at ``|``, ``&&`` and ``;``; ``VAR=$(cmd ...)``
    gives ``cmd ...``; ``VAR=value`` prefixes dropped (a line of assignments only: none)."""
    out, cur = [], []
    for w in [*words, "|"]:
        if w in ("|", "&&", ";"):
            while cur and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", cur[0]):
                sub = re.fullmatch(r"[A-Z_][A-Z0-9_]*=\$\((.*)", cur[0])
                if sub and cur[-1].endswith(")"):  # VAR=$(command ...)
                    cur = [sub.group(1), *cur[1:-1], cur[-1][:-1]]
                    break
                cur = cur[1:]
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append(w)
    return out


def check_command(words: list[str], monkeypatch) -> None:
    """AssertionError unless the command line ``words`` would start as the page says."""
    for simple in segments(words):
        check_simple(simple, monkeypatch)


def check_simple(words: list[str], monkeypatch) -> None:
    """AssertionError unless the simple command ``words`` would start as the page says."""
    from torch.distributed.run import get_args_parser

    neuron_only = words[0] == "neuron_parallel_compile"
    words = words[1:] if neuron_only else words
    head, rest = words[0], words[1:]
    if head == "torchrun":
        run = get_args_parser().parse_args(rest)
        world = int(run.nproc_per_node) * int(str(run.nnodes).split(":")[-1])
        target = ["-m", run.training_script] if run.module else [run.training_script]
        _check_python(target + run.training_script_args, world, neuron_only, monkeypatch)
    elif head in ("python", ".venv/bin/python"):
        _check_python(rest, 1, neuron_only, monkeypatch)
    elif head == "neuron-tp":
        _check_cli(rest, 1, neuron_only, monkeypatch)
    elif head.endswith("compile_and_train.sh"):  # NPROC then train.py options, on Neuron
        _check_file(head.removeprefix("./"), executable=True)
        assert rest and rest[0].isdigit(), f"{head} takes NPROC first, got {rest}"
        _check_cli(["train", *rest[1:]], int(rest[0]), True, monkeypatch)
    elif head.removeprefix("./") == "k8s/render.sh":  # one manifest name
        _check_file("k8s/render.sh", executable=True)
        assert len(rest) == 1, f"{head} takes one manifest name, got {rest}"
        _check_file(f"k8s/{rest[0]}.yaml")
    elif head.endswith(".sh"):
        assert not rest, f"{head} takes no arguments here"
        _check_file(head.removeprefix("./"), executable=True)
    elif head in EXTERNAL:
        pass
    else:
        raise AssertionError(f"test_readme does not know how to check {shlex.join(words)!r}")


def _line_order(key: str) -> tuple[int, int]:
    page, line = key.split(":L")
    return DOCS.index(page), int(line)


@pytest.mark.parametrize("line", sorted(COMMANDS, key=_line_order))
def test_bash_command_is_valid(line, monkeypatch):
    monkeypatch.chdir(REPO)
    try:
        check_command(COMMANDS[line], monkeypatch)
    except (AssertionError, ValueError) as e:
        raise AssertionError(f"{line}: {shlex.join(COMMANDS[line])}\n{e}") from e

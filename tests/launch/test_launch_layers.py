"""dpro-launch's shared plumbing names no launcher: what is Horovod's, torch's, TF's or MXNet's lives in that
launcher's module (``launch/<name>_run.py``; ``node.py`` is the torch launcher's per-host agent) and reaches the
shared modules through the launcher protocol (``dpro.launch.launcher``). The registry (``launchers.py``) lists the
launchers, and the auto-attach directory belongs to the plugins.

What counts as naming a launcher is code: identifiers, imports and string values. What the user reads may name one:
docstrings and the messages, help texts and titles handed to ``UsageError``, the log, ``print`` and argparse."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import dpro.launch
from dpro.launch.launchers import LAUNCHERS

LAUNCH = Path(dpro.launch.__file__).parent
LAUNCHER_MODULES = {"launchers.py", "node.py"}  # the registry; the torch launcher's agent
# each launcher's words besides its name: its tools, environment prefixes, libraries and the jobs it runs
VOCABULARY = ("horovodrun", "hvd", "torchrun", "torchelastic", "ddp", "fsdp", "tensorflow", "keras", "dmlc",
              "ps-lite", "gloo", "nccl", "mpi")
MESSAGES = {"UsageError", "ArgumentParser", "add_argument_group", "_say", "print", "info", "warning", "error",
            "debug"}
PROSE_KEYWORDS = {"help", "description", "epilog", "title"}


def shared_modules(root: Path = LAUNCH) -> list[Path]:
    """The launcher-neutral modules: every module of launch/ but the launchers' own, the registry and autoattach/."""
    return sorted(p for p in root.glob("*.py") if not p.name.endswith("_run.py") and p.name not in LAUNCHER_MODULES)


def _prose(tree: ast.AST) -> set[int]:
    """The nodes of what the user reads: docstrings (any bare string statement) and what messages are made of."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, (ast.Constant, ast.JoinedStr)):
            skipped.update(id(sub) for sub in ast.walk(node))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in MESSAGES:
                for arg in node.args:
                    skipped.update(id(sub) for sub in ast.walk(arg))
            for kw in node.keywords:
                if kw.arg in PROSE_KEYWORDS or name in MESSAGES:
                    skipped.update(id(sub) for sub in ast.walk(kw.value))
    return skipped


def code_words(source: str) -> list[str]:
    """The identifiers, imported names and string values of ``source``, prose left out."""
    tree = ast.parse(source)
    skipped = _prose(tree)
    words: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words.append(node.name)
        elif isinstance(node, ast.arg):
            words.append(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            words.append(node.arg)
        elif isinstance(node, ast.alias):
            words += [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            words.append(node.module or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words.append(node.value)
    return words


def launcher_names_in(source: str) -> set[str]:
    """The launcher names and words that ``source``'s code says (a word starts at a non-letter, non-digit)."""
    said = set()
    for word in (*LAUNCHERS, *VOCABULARY):
        pattern = re.compile(rf"(?<![a-z0-9]){re.escape(word)}" + (r"(?![a-z0-9])" if len(word) <= 3 else ""))
        if any(pattern.search(text.lower()) for text in code_words(source)):
            said.add(word)
    return said


def test_the_checker_finds_a_launcher_in_code_but_not_in_prose() -> None:
    assert launcher_names_in('ENV = {"HOROVOD_CYCLE_TIME": "1"}\n') == {"horovod"}
    assert launcher_names_in("from dpro.launch.horovod_run import HorovodSettings\n") == {"horovod"}
    assert launcher_names_in('if config.engine in ("tf", "mxnet"):\n    pass\n') == {"tf", "mxnet"}
    assert launcher_names_in('MARKS = ("import horovod",)\n') == {"horovod"}
    assert launcher_names_in("def f(torchrun_style):\n    return torchrun_style\n") == {"torch", "torchrun"}
    assert launcher_names_in('"""Horovod, torch, tf."""\nraise UsageError(f"--engine tf: {x} (horovodrun)")\n'
                             'p.add_argument("--x", help="HOROVOD_X")\n') == set()
    assert launcher_names_in('after = "shift"\nlearning = "platform"\n') == set()  # tf and mpi inside words


def test_no_shared_launch_module_names_a_launcher() -> None:
    modules = shared_modules()
    assert {p.name for p in modules} >= {"cli.py", "env.py", "settings.py", "pipeline.py", "process.py",
                                         "launcher.py"}
    offenders = {p.name: sorted(said) for p in modules if (said := launcher_names_in(p.read_text(encoding="utf-8")))}
    assert not offenders, offenders

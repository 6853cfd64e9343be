"""Mutated inputs for every reader, shared by the fuzz tests (tests/io/test_fuzz.py) and the longer campaign
(bench/fuzz.py).

A *seed* is a valid input written into a folder: a run directory (hand-written torch and Horovod runs, the
recorded MXNet run in tests/data), a Kineto trace, an applied config. A ``Mutation`` is plain data that
changes one file of a seed (one JSON value replaced, removed or nested deep; bytes cut or flipped; the file
swapped for a directory, a link to /dev/zero or a gzip bomb) or one ``--set`` argument, so a failing case is a
line of JSON that replays exactly (tests/data/fuzz/corpus.jsonl).

``in_process(seed, root)`` runs the seed's readers in this process; ``cli_argv(seed, root, mutation)`` is the
command a user would type. Either must end in success or one ``DproError``; anything else is a bug.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import math
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from run_builder import (
    horovod_timeline_events,
    horovod_timeline_text,
    make_horovod_run,
    make_run,
    write_journal,
    write_rows_journal,
)

DATA = Path(__file__).resolve().parent / "data"
CORPUS = DATA / "fuzz" / "corpus.jsonl"

# values a hostile or broken file holds where a number, a name or a list belongs
HOSTILE_VALUES: tuple[Any, ...] = (
    math.nan, math.inf, -math.inf, -1, 0, 1e18, 10**30, -(10**30), 0.5, "", "abc", "1e3", True, False, None,
    [], {}, [1, 2], [[[]]], {"a": 1}, "../../outside", "/dev/zero", "\u0000", "x" * 10_000, [math.nan], [None],
    {"": None}, 2**63, -(2**63), 1e-300,
)
# values that make every object alike when one key is set to them everywhere (one correlation id, one step)
DEGENERATE_VALUES: tuple[Any, ...] = (1, 3, 0, "X", "COMM", "STEP", "compute", 1000.0)
# what the whatif knobs are set to on the command line
SET_VALUES: tuple[str, ...] = (
    "x", "-1", "0", "NaN", "Infinity", "-Infinity", "1e400", "[]", "{}", "[1,2]", "null", "true", '"a"', "",
    "[[[[[[[[[[1]]]]]]]]]]", "1" * 400, "[" * 30_000 + "]" * 30_000, '{"a": [1, {"b": null}]}', "2.5", "1e18",
    "a,b,c", '["fc1"]', '[["fc1.weight"]]', "[1]",
)
FILE_OPS = ("set", "set", "set", "set", "set_all", "set_all", "delete", "delete", "nest", "repeat", "truncate", "flip",
            "empty", "directory", "symlink", "remove", "gzip_bomb")
BYTE_OPS = ("truncate", "truncate", "flip", "flip", "flip", "empty", "directory", "symlink", "remove")


@dataclass(frozen=True)
class Mutation:
    """One change to a seed, as data.

    ``file`` is relative to the seed's folder ("" for a ``--set`` argument). ``op`` is one of ``FILE_OPS`` or
    ``"set_arg"``; ``path`` locates a JSON value (keys and indices; a journal's first index is its line);
    ``value`` is the new value (set; set_all: of key ``path[0]`` in every object), the depth (nest), the copies
    (repeat), a position in [0, 1) (truncate, flip), the link target ("/dev/zero" or "outside", symlink), or
    ``KNOB=VALUE`` (set_arg).
    """

    file: str
    op: str
    path: tuple[Any, ...] = ()
    value: Any = None

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "op": self.op, "path": list(self.path), "value": _encode(self.value)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Mutation:
        return cls(doc["file"], doc["op"], tuple(doc.get("path", ())), _decode(doc.get("value")))


def _encode(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as {"float": "nan"} so the corpus stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": {k: _encode(v) for k, v in value.items()}}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"float"}:
        return float(value["float"])
    if isinstance(value, dict) and set(value) == {"dict"}:
        return {k: _decode(v) for k, v in value["dict"].items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


# ---- seeds ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seed:
    """A valid input: ``build(root)`` writes it under ``root`` and returns the path the readers are given."""

    name: str
    build: Callable[[Path], Path]
    kind: str  # "run" (a run directory), "kineto" (a trace file), "config" (an applied config), "xplane" (a profile)
    commands: tuple[tuple[str, ...], ...] = field(default=())
    env: tuple[tuple[str, str], ...] = ()  # environment the commands read it under (limits made small)


def _torch_run(root: Path) -> Path:
    return make_run(root / "run")


def _long_run(root: Path) -> Path:
    """1,200 steps per rank (~2 MB files): under LONG_RUN_ENV they are read from their end, 30 steps kept."""
    return make_run(root / "run", steps=range(3, 1203))


LONG_RUN_ENV = (("DPRO_STREAM_MB", "1"), ("DPRO_MAX_STEPS", "30"))


def _journal_run(root: Path) -> Path:
    run = make_run(root / "run")
    (run / "rank-1.json").unlink()
    write_journal(run / "rank-1.partial.jsonl", 1, 2, range(3, 8), cut_step=8)
    return run


def _rows_journal_run(root: Path) -> Path:
    run = make_run(root / "run")
    (run / "rank-0.json").unlink()
    write_rows_journal(run / "rank-0.partial.jsonl", 0, 2, range(3, 8))
    return run


def _horovod_run(root: Path) -> Path:
    return make_horovod_run(root / "run", horovod_timeline_text(horovod_timeline_events([3, 4])))


def _mxnet_run(root: Path) -> Path:
    return Path(shutil.copytree(DATA / "mxnet" / "mlp-2workers-2servers", root / "run"))


def _kineto_trace(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(DATA / "kineto" / "single_gpu_rank0.json.gz", root / "trace.pt.trace.json.gz"))


def _kineto_ddp_trace(root: Path) -> Path:
    """Rank 0 of a 2-GPU DDP job (NCCL kernels, 40k events): big enough for degenerate ids to show."""
    root.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(DATA / "kineto" / "ddp2_rank0_nccl.json.gz", root / "rank0.pt.trace.json.gz"))


def _config(root: Path) -> Path:
    from dpro.config import write_config
    from dpro.engines import load_prepared
    from dpro.optimize import config_document, optimize
    from dpro.sim.whatif import context

    ctx = context(load_prepared(_horovod_run(root / "source")))
    doc = config_document(optimize(ctx), ctx)
    from dpro.config import Config

    path = write_config(root / "config.json", Config.from_json(doc))
    shutil.rmtree(root / "source")
    return path


RUN_COMMANDS = (("info", "{path}"), ("analyze", "{path}"), ("whatif", "{path}", "--set", "bandwidth_scale=2"),
                ("optimize", "{path}"))
SEEDS: dict[str, Seed] = {s.name: s for s in (
    Seed("torch-run", _torch_run, "run", RUN_COMMANDS),
    Seed("long-run", _long_run, "run", RUN_COMMANDS, env=LONG_RUN_ENV),
    Seed("journal-run", _journal_run, "run", RUN_COMMANDS),
    Seed("rows-journal-run", _rows_journal_run, "run", RUN_COMMANDS),
    Seed("horovod-run", _horovod_run, "run", RUN_COMMANDS),
    Seed("mxnet-run", _mxnet_run, "run", RUN_COMMANDS),
    Seed("kineto", _kineto_trace, "kineto", (("analyze", "{path}"),)),
    Seed("kineto-ddp", _kineto_ddp_trace, "kineto", (("analyze", "{path}"),)),
    Seed("config", _config, "config", (("--apply", "{path}"),)),
)}


def seed_files(seed_path: Path) -> list[str]:
    """The files of a built seed that mutations change, relative to its folder (the seed itself if a file)."""
    if seed_path.is_file():
        return [seed_path.name]
    return sorted(str(p.relative_to(seed_path)) for p in seed_path.rglob("*") if p.is_file())


# ---- mutations --------------------------------------------------------------------------------------------


def read_doc(path: Path) -> Any:
    """A seed file's JSON (a journal as a list of its lines' documents)."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    text = raw.decode()
    if path.name.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if _whole_json(line)]
    return json.loads(text)


def _whole_json(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def write_doc(path: Path, doc: Any, *, gz: bool) -> None:
    if path.name.endswith(".jsonl"):
        text = "\n".join(json.dumps(line) for line in doc) + "\n"
    else:
        text = json.dumps(doc)
    text = _DEEP_MARK.sub(lambda m: "[" * int(m.group(1)) + "1" + "]" * int(m.group(1)), text)
    data = text.encode()
    path.write_bytes(gzip.compress(data) if gz else data)


def value_paths(doc: Any, limit: int = 4000, ends: int = 100) -> list[tuple[Any, ...]]:
    """Paths to the values of a JSON document, breadth first, at most ``limit`` of them; of a list longer than
    ``2 * ends`` only the first and the last ``ends`` items (a long trace is read from its end too)."""
    out: list[tuple[Any, ...]] = []
    queue: list[tuple[tuple[Any, ...], Any]] = [((), doc)]
    while queue and len(out) < limit:
        path, node = queue.pop(0)
        if isinstance(node, list) and len(node) > 2 * ends:
            items = [*enumerate(node[:ends]), *((len(node) - ends + i, v) for i, v in enumerate(node[-ends:]))]
        else:
            items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            out.append((*path, key))
            if isinstance(child, (dict, list)):
                queue.append(((*path, key), child))
    return out


def random_mutation(rng: random.Random, seed_path: Path, seed: Seed) -> Mutation:
    """A random change to one file of the built seed (or, for run directories, sometimes a ``--set`` value)."""
    if seed.kind == "run" and rng.random() < 0.1:
        from dpro.config import knob_table

        knob = rng.choice(sorted(k.name for k in knob_table().values() if k.whatif))
        return Mutation("", "set_arg", (), f"{knob}={rng.choice(SET_VALUES)}")
    files = seed_files(seed_path)
    name = rng.choice(files)
    op = rng.choice(FILE_OPS)
    target = seed_path / name if seed_path.is_dir() else seed_path
    if op in ("set", "delete", "nest", "repeat", "set_all"):
        paths = _sample_paths(rng, target)
        if not paths:  # not JSON (a protobuf, a cut file): its bytes
            op = rng.choice(BYTE_OPS)
            return Mutation(name, op, (), round(rng.random(), 6) if op in ("truncate", "flip") else
                            rng.choice(("/dev/zero", "outside")) if op == "symlink" else None)
        if op == "set_all":
            keys = sorted({p[-1] for p in paths if isinstance(p[-1], str)})
            if keys:
                return Mutation(name, op, (rng.choice(keys),), rng.choice((*HOSTILE_VALUES, *DEGENERATE_VALUES)))
            op = "set"
        path = rng.choice(paths)
        value = {"set": lambda: rng.choice(HOSTILE_VALUES), "delete": lambda: None,
                 "nest": lambda: rng.choice((100, 2_000, 100_000)), "repeat": lambda: rng.choice((2, 50, 5_000))}[op]()
        return Mutation(name, op, path, value)
    if op in ("truncate", "flip"):
        return Mutation(name, op, (), round(rng.random(), 6))
    if op == "symlink":
        return Mutation(name, op, (), rng.choice(("/dev/zero", "outside")))
    if op == "directory" and seed.kind == "run" and rng.random() < 0.5:
        return Mutation(rng.choice(("analysis", "analysis/replay.json", "analysis/config.json")),
                        rng.choice(("directory", "symlink")), (), "outside")
    return Mutation(name, op)


def _sample_paths(rng: random.Random, path: Path) -> list[tuple[Any, ...]]:
    try:
        doc = read_doc(path)
    except (ValueError, OSError):
        return []
    paths = value_paths(doc)
    # deep paths (inside events) are most of a trace; keep some shallow ones in play too
    shallow = [p for p in paths if len(p) <= 2]
    return shallow if shallow and rng.random() < 0.4 else paths


def apply_mutation(seed_path: Path, mutation: Mutation, outside: Path) -> list[str]:
    """Change the built seed in place; return the extra arguments (``--set``) the command gets.

    ``outside`` is a folder beside the seed: links that lead out of the run point there, so a write through
    them can be seen.
    """
    if mutation.op == "set_arg":
        return ["--set", str(mutation.value)]
    base = seed_path if seed_path.is_dir() else seed_path.parent
    target = base / mutation.file
    op = mutation.op
    if op in ("set", "delete", "nest", "repeat", "set_all"):
        gz = target.read_bytes()[:2] == b"\x1f\x8b"
        doc = read_doc(target)
        doc = _change(doc, list(mutation.path), op, mutation.value)
        write_doc(target, doc, gz=gz)
    elif op == "truncate":
        raw = target.read_bytes()
        target.write_bytes(raw[: int(len(raw) * float(mutation.value))])
    elif op == "flip":
        raw = bytearray(target.read_bytes())
        if raw:
            at = min(int(len(raw) * float(mutation.value)), len(raw) - 1)
            raw[at] ^= 0xFF
        target.write_bytes(bytes(raw))
    elif op == "empty":
        target.write_bytes(b"")
    elif op == "remove":
        _remove(target)
    elif op == "directory":
        _remove(target)
        target.mkdir(parents=True)
        (target / "x.json").write_text("{}")
    elif op == "symlink":
        _remove(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink("/dev/zero" if mutation.value == "/dev/zero" else outside, target)
    elif op == "gzip_bomb":
        _remove(target)
        _write_gzip_bomb(target, 1 << 30)
    else:
        raise ValueError(f"unknown mutation {op!r}")
    return []


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _write_gzip_bomb(path: Path, size: int) -> None:
    """``size`` bytes of one character inside a gzip file of a few MB (made once per process)."""
    path.write_bytes(_gzip_bomb(size))


@functools.lru_cache(maxsize=2)
def _gzip_bomb(size: int) -> bytes:
    chunk = b"0" * (1 << 24)
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6) as f:
        f.write(b'{"traceEvents": [')
        for _ in range(size // len(chunk)):
            f.write(chunk)
    return out.getvalue()


def _change(doc: Any, path: list[Any], op: str, value: Any) -> Any:
    if op == "set_all":
        _set_everywhere(doc, path[0], value)
        return doc
    if not path:
        return _deep(value) if op == "nest" else value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if op == "set":
        parent[last] = value
    elif op == "delete":
        del parent[last]
    elif op == "nest":
        parent[last] = _deep(value)
    elif op == "repeat":
        item = parent[last]
        if isinstance(parent, list):
            parent[last:last + 1] = [item] * int(value)
        else:
            parent[last] = [item] * int(value)
    return doc


def _set_everywhere(doc: Any, key: str, value: Any) -> None:
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if key in node:
                node[key] = value
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))


def _deep(depth: int) -> str:
    """A marker that ``write_doc`` turns into ``depth`` nested lists (json.dumps itself would recurse)."""
    return f"{_DEEP}{int(depth)}@@"


_DEEP = "@@dpro-fuzz-deep-"
_DEEP_MARK = re.compile(re.escape(f'"{_DEEP}') + r'(\d+)@@"')


# ---- running the readers ------------------------------------------------------------------------------


def in_process(seed: Seed, seed_path: Path, extra: list[str]) -> None:
    """What the seed's commands read and compute, called directly (no files written except the run's analysis),
    under the seed's environment.

    Raises:
        DproError: the input is refused, with a message.
    """
    saved = {name: os.environ.get(name) for name, _ in seed.env}
    os.environ.update(dict(seed.env))
    try:
        _read_and_compute(seed, seed_path, extra)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _read_and_compute(seed: Seed, seed_path: Path, extra: list[str]) -> None:
    if seed.kind == "kineto":
        from dpro.analyze.traces import analyze_kineto

        analyze_kineto([seed_path])
    elif seed.kind == "config":
        from dpro.config import read_config

        read_config(seed_path)
    else:
        from dpro.engines import load_prepared
        from dpro.optimize import optimize
        from dpro.report.info import summarize_run
        from dpro.sim.whatif import context, parse_settings, predict

        run = load_prepared(seed_path)
        summarize_run(run)
        ctx = context(run)
        if extra:
            predict(ctx, parse_settings(extra[1:]))
        else:
            optimize(ctx)


def cli_argv(seed: Seed, seed_path: Path, extra: list[str], python: str, pick: int = 0) -> list[str]:
    """The command a user would type for this input (``pick`` chooses among the seed's commands)."""
    if seed.kind == "config":
        return [python, "-m", "dpro.launch", "--apply", str(seed_path), "--no-profile", "-np", "1",
                python, "-c", "pass"]
    if seed.kind == "xplane":
        return [python, "-m", "dpro", "import-xplane", str(seed_path), "-o", str(imported_run(seed_path))]
    if extra:
        return [python, "-m", "dpro", "whatif", str(seed_path), *extra]
    command = seed.commands[pick % len(seed.commands)]
    return [python, "-m", "dpro", *(str(seed_path) if a == "{path}" else a for a in command)]


def imported_run(seed_path: Path) -> Path:
    """Where ``dpro import-xplane`` writes the run of a mutated profile (beside it)."""
    return seed_path.parent / "imported-run"


def tree_state(root: Path, skip: Path | None = None) -> dict[str, tuple[int, int]]:
    """Size and mtime of every file under ``root`` (not following links), leaving out ``skip``."""
    state: dict[str, tuple[int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if skip is not None and (here == skip or skip in here.parents):
            dirnames[:] = []
            continue
        for name in filenames + [d for d in dirnames if (here / d).is_symlink()]:
            p = here / name
            st = p.lstat()
            state[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return state


def read_corpus(path: Path = CORPUS) -> list[tuple[str, Mutation, str]]:
    """The regression cases: (seed name, mutation, what it once did)."""
    if not path.is_file():
        return []
    cases = []
    for line in path.read_text().splitlines():
        if line.strip():
            doc = json.loads(line)
            cases.append((doc["seed"], Mutation.from_json(doc["mutation"]), doc.get("found", "")))
    return cases

"""The applied config: what dpro chose for a job, written so that the next run uses it.

The schema is docs/architecture.md "The applied config"::

    {"schema": "dpro.config/1",
     "fingerprint": {"framework": "torch", "engine": "<run.json's engine>", "world_size": 2, "model": "3f2a..."},
     "baseline":  {"run": "runs/a", "step_ms": 412.0},
     "predicted": {"step_ms": 301.0, "peak_memory_bytes": 1200000000},
     "knobs": {"<an engine knob>": 6.5, "recompute": ["encoder.layers.3"]},
     "explain": [{"knob": "recompute", "why": "...", "predicted_gain_ms": -4.0}]}

Every knob dpro can change is named once, in ``knob_table()`` (common knobs here, each engine's in
its engine module), and applied by one plugin function
(``dpro.plugins.torch.apply`` for the torch knobs; ``env`` is set by the launcher). ``baseline``
and ``predicted`` may be null in a config written by hand; ``explain`` may be empty.

``read_config`` validates everything and raises ``ConfigError`` naming the file, the key and what
is wrong. Only JSON is read, with ``json.loads``; nothing in a config is ever executed.
``read_config(write_config(path, config)) == config``.

A config is applied only to the job it was made for: ``check_fingerprint`` refuses a config whose
framework, engine, world size or model differ from the job's, unless ``force=True``.

Example::

    config = read_config(os.environ[DPRO_CONFIG])
    check_fingerprint(config, framework="torch", engine=run_engine, world_size=2, model=fp)
    print(config.knobs.get("recompute"))
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpro.errors import ConfigError, kind_of, shown
from dpro.io.limits import WORLD_SIZE_ENV, parse_bounded_json, read_bounded, world_size_limit
from dpro.record import job_env
from dpro.record.trace import ROOT_MODULE, write_json_atomic

__all__ = [
    "CONFIG_FILE",
    "CONFIG_SCHEMA",
    "COMPRESSIONS",
    "DPRO_CONFIG",
    "COMMON_KNOBS",
    "Baseline",
    "Config",
    "Explanation",
    "Fingerprint",
    "Knob",
    "Predicted",
    "check_fingerprint",
    "find_config",
    "knob_table",
    "knob_table_markdown",
    "read_config",
    "write_config",
]

CONFIG_SCHEMA = "dpro.config/1"
CONFIG_FILE = "config.json"
DPRO_CONFIG = job_env.CONFIG
"""The environment variable holding the path of the config a job applies (set by ``dpro-launch``)."""

COMPRESSIONS = (None, "fp16", "bf16")


# ---- value checks: each returns the normalized value or raises ConfigError(source, problem, key) ----


def _string(value: Any, source: str, key: str, *, empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ConfigError(source, f"must be a string, found {shown(value)}", key)
    if not value and not empty:
        raise ConfigError(source, "must not be empty", key)
    return value


def _number(value: Any, source: str, key: str, *, positive: bool = False, what: str = "a number") -> float:
    """A finite int or float (never a bool), >= 0, or > 0 when ``positive``; returned as float."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(source, f"must be {what}, found {shown(value)}", key)
    try:
        value = float(value)
    except OverflowError:  # an int beyond float's range
        raise ConfigError(source, f"must be {what}, found {shown(value)}", key) from None
    if not math.isfinite(value):
        raise ConfigError(source, f"must be {what}, found {value}", key)
    if value < 0 or (positive and value == 0):
        raise ConfigError(source, f"must be {what}, found {value:g}", key)
    return value


def _count(value: Any, source: str, key: str, *, positive: bool = False) -> int:
    """A whole number (an integral float such as 1e9 is accepted), >= 0, or > 0 when ``positive``."""
    what = "a positive whole number" if positive else "a whole number >= 0"
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (positive and value == 0):
        raise ConfigError(source, f"must be {what}, found {shown(value)}", key)
    if value > INT64_MAX:  # what frameworks store a count or size in; beyond it float() overflows downstream
        raise ConfigError(source, f"must be {what} up to 2^63 - 1, found {shown(value)}", key)
    return value


INT64_MAX = 2**63 - 1


def _optional(check: Callable[..., Any]) -> Callable[..., Any]:
    def optional(value: Any, source: str, key: str, **kw: Any) -> Any:
        return None if value is None else check(value, source, key, **kw)

    return optional


def _list(value: Any, source: str, key: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(source, f"must be a list, found {shown(value)}", key)
    return list(value)


def _mapping(value: Any, source: str, key: str, fields: tuple[str, ...], required: tuple[str, ...]) -> dict:
    """A JSON object with only ``fields``, holding at least ``required``."""
    if not isinstance(value, Mapping):
        raise ConfigError(source, f"must be an object with {', '.join(fields)}, found {shown(value)}", key)
    unknown = sorted(str(k) for k in value if k not in fields)
    if unknown:
        raise ConfigError(source, f"unknown key {unknown[0]!r}; expected {', '.join(fields)}", key)
    missing = [k for k in required if k not in value]
    if missing:
        raise ConfigError(source, f"{missing[0]!r} is missing", key)
    return dict(value)


def _names(value: Any, source: str, key: str, seen: dict[str, str]) -> list[str]:
    """A list of distinct non-empty strings; ``seen`` maps each name to the key it first appeared at."""
    names = _list(value, source, key)
    for i, name in enumerate(names):
        at = f"{key}[{i}]"
        _string(name, source, at)
        if name in seen:
            raise ConfigError(source, f"{name!r} appears twice (first at {seen[name]})", at)
        seen[name] = at
    return names


# ---- the knobs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Knob:
    """One knob dpro can change or predict: its name, its one-line doc, its check (value, source, key) -> value,
    the value in force when a run does not say, and where it can be used (``whatif --set``, a config)."""

    name: str
    doc: str
    check: Callable[[Any, str, str], Any]
    default: Any = None
    whatif: bool = True      # ``dpro whatif --set NAME=VALUE`` can predict it
    config: bool = True      # a config.json may set it (the plugins or the launcher apply it)
    engine: str = ""         # the engine that owns it ("" for every engine)


def _bucket_cap(value: Any, source: str, key: str) -> float:
    return _number(value, source, key, positive=True, what="a positive number of MiB")


def _tensor_groups(value: Any, source: str, key: str) -> list[list[str]]:
    seen: dict[str, str] = {}
    groups = []
    for i, group in enumerate(_list(value, source, key)):
        names = _names(group, source, f"{key}[{i}]", seen)
        if not names:
            raise ConfigError(source, "a tensor group must name at least one gradient", f"{key}[{i}]")
        groups.append(names)
    return groups


def _recompute(value: Any, source: str, key: str) -> list[str]:
    return _names(value, source, key, {})


def _compile(value: Any, source: str, key: str) -> list[str]:
    """Module paths to compile, none inside another (``<root>``, the whole model, alone)."""
    paths = _names(value, source, key, {})
    for i, path in enumerate(paths):
        outer = next((o for o in paths if o != path and (o == ROOT_MODULE or path.startswith(o + "."))), None)
        if outer is not None:
            raise ConfigError(source, f"{path!r} lies inside {outer!r}, which is compiled as a whole", f"{key}[{i}]")
    return paths


def _compression(value: Any, source: str, key: str) -> str | None:
    if value not in COMPRESSIONS or isinstance(value, bool):
        raise ConfigError(source, f"must be null, \"fp16\" or \"bf16\", found {shown(value)}", key)
    return value


MAX_MICRO_BATCHES = 1024


def _micro_batches(value: Any, source: str, key: str) -> int:
    k = _count(value, source, key, positive=True)
    if k > MAX_MICRO_BATCHES:
        raise ConfigError(source, f"must be at most {MAX_MICRO_BATCHES} micro-batches, found {k}", key)
    return k


def _env(value: Any, source: str, key: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(source, f"must be an object of environment variables, found {shown(value)}", key)
    env = {}
    for name, setting in value.items():
        at = f"{key}[{name!r}]"
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise ConfigError(source, f"{name!r} is not an environment variable name", at)
        if not isinstance(setting, str):
            raise ConfigError(source, f"must be a string (environment values are text), found {shown(setting)}",
                              at)
        if "\0" in setting:  # the operating system cannot pass it
            raise ConfigError(source, "an environment value cannot hold a NUL character", at)
        env[name] = setting
    return env


def _check_env_allowed(env: Mapping[str, str], engine: str, source: str) -> None:
    """A config's env may set only the variables its engine's knobs are applied through (``Engine.env_variables``):
    a config travels between people and must not put anything else into a job's environment."""
    if not env:
        return
    from dpro.engines import get_engine  # the engine modules import this one

    allowed = get_engine(engine).env_variables
    for name in env:
        if name not in allowed:
            owned = ", ".join(allowed) if allowed else "none"
            raise ConfigError(source, f"a config may set only the environment variables its engine's knobs own "
                              f"(engine {engine or '?'}: {owned}); {name} is not one of them",
                              f"knobs.env[{name!r}]")


def _positive_number(value: Any, source: str, key: str) -> float:
    return _number(value, source, key, positive=True, what="a positive number")


def _world_size(value: Any, source: str, key: str) -> int:
    size = _count(value, source, key, positive=True)
    if size > world_size_limit():
        raise ConfigError(source, f"{size} ranks is above the {world_size_limit():,} dpro models "
                                  f"(${WORLD_SIZE_ENV} raises the limit)", key)
    return size


COMMON_KNOBS: tuple[Knob, ...] = (
    Knob("tensor_groups", "gradient names grouped into collectives, groups in gradient-ready (backward) order",
         _tensor_groups),
    Knob("recompute", "module paths whose activations are recomputed in backward", _recompute, default=[]),
    Knob("gradient_compression", "null, \"fp16\" or \"bf16\": gradients cast for the wire", _compression),
    Knob("amp", "null, \"bf16\" or \"fp16\": forward and loss under autocast (priced by the recorder's probe "
         "passes; changes numerics)", _compression),
    Knob("micro_batches", "k >= 1: the step's samples as k forward/backward passes (micro-batches), gradients "
         "communicated after the last (priced by the recorder's probe passes; a run recorded with gradient "
         "accumulation runs as many as its step's passes)", _micro_batches, default=1),
    Knob("compile", f"module paths run under torch.compile, or Gluon blocks hybridized with static_alloc "
         f"({ROOT_MODULE}: the whole model; Keras: {ROOT_MODULE} only, jit_compile; priced by the recorder's compile "
         "probe)", _compile, default=[]),
    Knob("env", "environment variables set by the launcher (name -> text)", _env, default={}, whatif=False),
    Knob("world_size", "number of ranks (communication priced for N ranks)", _world_size, config=False),
    Knob("bandwidth_scale", "network bandwidth times k (e.g. 10 for 1 -> 10 Gbit/s)", _positive_number,
         default=1.0, config=False),
    Knob("compute_scale", "compute time times k (e.g. 0.5 for a device twice as fast)", _positive_number,
         default=1.0, config=False),
)


def knob_table_markdown() -> str:
    """The knob table as Markdown (the README's copy is checked against this by a test)."""
    rows = ["| knob | engine | what it is | what-if | config |", "|---|---|---|---|---|"]
    for knob in knob_table().values():
        rows.append(f"| `{knob.name}` | {knob.engine or 'any'} | {knob.doc} | {'yes' if knob.whatif else '-'} | "
                    f"{'yes' if knob.config else '-'} |")
    return "\n".join(rows)


def knob_table() -> dict[str, Knob]:
    """Every knob: the common ones and every registered engine's (``dpro.engines``), by name."""
    from dpro.engines import engine_knobs

    return {knob.name: knob for knob in (*COMMON_KNOBS, *engine_knobs())}


def _knobs(value: Any, source: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(source, f"must be an object of knobs, found {shown(value)}", "knobs")
    knobs = {}
    table = knob_table()
    for name, setting in value.items():
        key = f"knobs[{json.dumps(name) if isinstance(name, str) else repr(name)}]"
        knob = table.get(name) if isinstance(name, str) else None
        if knob is None or not knob.config:
            known = ", ".join(n for n, k in table.items() if k.config)
            raise ConfigError(source, f"unknown knob {name!r}; a config may set {known}", key)
        knobs[name] = knob.check(setting, source, key)
    return knobs


# ---- the config ------------------------------------------------------------------------------------


@dataclass
class Fingerprint:
    """The job a config was made for; a config applies only to a job with the same fingerprint."""

    framework: str
    engine: str
    world_size: int
    model: str

    FIELDS = ("framework", "engine", "world_size", "model")

    @classmethod
    def coerce(cls, value: Any, source: str, key: str = "fingerprint") -> Fingerprint:
        raw = value.__dict__ if isinstance(value, Fingerprint) else _mapping(value, source, key, cls.FIELDS,
                                                                               cls.FIELDS)
        return cls(framework=_string(raw["framework"], source, f"{key}.framework"),
                   engine=_string(raw["engine"], source, f"{key}.engine"),
                   world_size=_count(raw["world_size"], source, f"{key}.world_size", positive=True),
                   model=_string(raw["model"], source, f"{key}.model"))

    def to_json(self) -> dict[str, Any]:
        return {"framework": self.framework, "engine": self.engine, "world_size": self.world_size,
                "model": self.model}


@dataclass
class Baseline:
    """The run the config was derived from and its measured step time."""

    run: str
    step_ms: float

    FIELDS = ("run", "step_ms")

    @classmethod
    def coerce(cls, value: Any, source: str, key: str = "baseline") -> Baseline:
        raw = value.__dict__ if isinstance(value, Baseline) else _mapping(value, source, key, cls.FIELDS,
                                                                           cls.FIELDS)
        return cls(run=_string(raw["run"], source, f"{key}.run"),
                   step_ms=_number(raw["step_ms"], source, f"{key}.step_ms", what="a number of ms >= 0"))

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "step_ms": self.step_ms}


@dataclass
class Predicted:
    """What the replay predicts with the config applied (peak memory may be unknown: None)."""

    step_ms: float
    peak_memory_bytes: int | None = None

    FIELDS = ("step_ms", "peak_memory_bytes")

    @classmethod
    def coerce(cls, value: Any, source: str, key: str = "predicted") -> Predicted:
        raw = value.__dict__ if isinstance(value, Predicted) else _mapping(value, source, key, cls.FIELDS,
                                                                            ("step_ms",))
        return cls(step_ms=_number(raw["step_ms"], source, f"{key}.step_ms", what="a number of ms >= 0"),
                   peak_memory_bytes=_optional(_count)(raw.get("peak_memory_bytes"), source,
                                                       f"{key}.peak_memory_bytes"))

    def to_json(self) -> dict[str, Any]:
        return {"step_ms": self.step_ms, "peak_memory_bytes": self.peak_memory_bytes}


@dataclass
class Explanation:
    """Why one knob was chosen, and the step time it is predicted to save (None: not priced)."""

    knob: str
    why: str
    predicted_gain_ms: float | None = None

    FIELDS = ("knob", "why", "predicted_gain_ms")

    @classmethod
    def coerce(cls, value: Any, source: str, key: str) -> Explanation:
        raw = value.__dict__ if isinstance(value, Explanation) else _mapping(value, source, key, cls.FIELDS,
                                                                              ("knob", "why"))
        gain = raw.get("predicted_gain_ms")
        if gain is not None and (not isinstance(gain, (int, float)) or isinstance(gain, bool)
                                 or not math.isfinite(gain)):
            raise ConfigError(source, f"must be a number of ms or null, found {shown(gain)}",
                              f"{key}.predicted_gain_ms")
        return cls(knob=_string(raw["knob"], source, f"{key}.knob"), why=_string(raw["why"], source, f"{key}.why",
                                                                                  empty=True),
                   predicted_gain_ms=None if gain is None else float(gain))

    def to_json(self) -> dict[str, Any]:
        return {"knob": self.knob, "why": self.why, "predicted_gain_ms": self.predicted_gain_ms}


@dataclass
class Config:
    """An applied config (docs/architecture.md "The applied config"), validated when it is made.

    Nested parts may be given as the dataclasses or as plain dicts; knob values are normalized
    (bucket sizes to float, groups to lists), so a config equals itself read back from disk.
    ``path`` is the file it was read from (not part of the config; not compared).

    Raises:
        ConfigError: naming ``path`` (or "Config"), the key and what is wrong.

    Example:
        >>> cfg = Config(fingerprint={"framework": "torch", "engine": engine, "world_size": 2,
        ...                           "model": "3f2a"}, knobs={"recompute": ["encoder.0"]})
        >>> cfg.knobs["recompute"]
        ['encoder.0']
    """

    fingerprint: Fingerprint
    knobs: dict[str, Any] = field(default_factory=dict)
    baseline: Baseline | None = None
    predicted: Predicted | None = None
    explain: list[Explanation] = field(default_factory=list)
    schema: str = CONFIG_SCHEMA
    path: Path | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.path is not None:
            self.path = Path(self.path)
        source = self.source
        if self.schema != CONFIG_SCHEMA:
            raise ConfigError(source, f"schema {self.schema!r} is not supported; this dpro reads {CONFIG_SCHEMA}",
                              "schema")
        self.fingerprint = Fingerprint.coerce(self.fingerprint, source)
        self.knobs = _knobs(self.knobs, source)
        _check_env_allowed(self.knobs.get("env") or {}, self.fingerprint.engine, source)
        self.baseline = None if self.baseline is None else Baseline.coerce(self.baseline, source)
        self.predicted = None if self.predicted is None else Predicted.coerce(self.predicted, source)
        self.explain = [Explanation.coerce(e, source, f"explain[{i}]")
                        for i, e in enumerate(_list(self.explain, source, "explain"))]

    @property
    def source(self) -> str:
        """How error messages name this config: its file, or "Config" for one built in memory."""
        return str(self.path) if self.path is not None else "Config"

    def to_json(self) -> dict[str, Any]:
        """The JSON document (plain dicts and lists) that ``write_config`` writes."""
        return {
            "schema": self.schema,
            "fingerprint": self.fingerprint.to_json(),
            "baseline": None if self.baseline is None else self.baseline.to_json(),
            "predicted": None if self.predicted is None else self.predicted.to_json(),
            "knobs": json.loads(json.dumps(self.knobs)),  # a deep copy of plain JSON values
            "explain": [e.to_json() for e in self.explain],
        }

    @classmethod
    def from_json(cls, doc: Any, source: str | Path = "Config") -> Config:
        """A config from its JSON document; ``source`` names it in errors (and becomes ``path``)."""
        src = str(source)
        if not isinstance(doc, Mapping):
            raise ConfigError(src, f"must be a JSON object (a dpro config), found {kind_of(doc)}")
        if "schema" not in doc:
            raise ConfigError(src, f"no 'schema' key; this dpro reads {CONFIG_SCHEMA} — is this a dpro config?",
                              "schema")
        if doc["schema"] != CONFIG_SCHEMA:
            raise ConfigError(src, f"schema {doc['schema']!r} is not supported; this dpro reads {CONFIG_SCHEMA}",
                              "schema")
        fields = ("schema", "fingerprint", "baseline", "predicted", "knobs", "explain")
        raw = _mapping(doc, src, None, fields, ("schema", "fingerprint", "knobs"))
        return cls(fingerprint=raw["fingerprint"], knobs=raw["knobs"], baseline=raw.get("baseline"),
                   predicted=raw.get("predicted"), explain=raw.get("explain") or [], schema=raw["schema"],
                   path=None if source == "Config" else Path(source))


# ---- files -----------------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def write_config(path: str | Path, config: Config) -> Path:
    """Write ``config`` to ``path`` atomically (temp file + rename); make the directory if needed.

    Returns:
        The path written, so ``read_config(write_config(path, config)) == config``.
    """
    if not isinstance(config, Config):
        raise TypeError(f"write_config: expected a dpro.config.Config, got {type(config).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, config.to_json())
    return path


def read_config(path: str | Path) -> Config:
    """Read and validate a config file.

    Raises:
        ConfigError: the file is missing or not JSON, has another schema, an unknown knob, a value of
            the wrong type or range; the message names the file and the key.
    """
    path = Path(path)
    try:
        text = read_bounded(path, ConfigError).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(path, "no such file; pass the config.json that `dpro optimize` wrote") from None
    except UnicodeDecodeError as err:
        raise ConfigError(path, f"not UTF-8 text (byte {err.start}); is this a JSON file?") from err
    except OSError as err:
        raise ConfigError(path, f"cannot be read: {err.strerror or err}") from err
    if not text.strip():
        raise ConfigError(path, "the file is empty, not JSON")
    try:
        doc = parse_bounded_json(text, path, ConfigError, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise ConfigError(path, f"not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from err
    except ValueError as err:
        raise ConfigError(path, f"not valid JSON: {err}") from err
    return Config.from_json(doc, path)


# ---- does a config fit this job? ---------------------------------------------------------------------


def check_fingerprint(
    config: Config, *, framework: str, engine: str, world_size: int, model: str, force: bool = False,
    source: str | Path = "",
) -> list[str]:
    """Check that ``config`` was made for this job; refuse it otherwise.

    Args:
        config: the config to apply.
        framework, engine, world_size, model: this job's (``model`` is the hash that the recorder
            writes as ``model_fingerprint`` in run.json).
        force: apply a mismatching config anyway; the mismatches are returned so the caller can warn.
        source: how to name the config in the message (default: the file it was read from).

    Returns:
        One line per mismatch ("config was made for world_size 4, this job has 2"); empty if it fits.

    Raises:
        ConfigError: when anything differs and ``force`` is False.
    """
    job = {"framework": framework, "engine": engine, "world_size": world_size, "model": model}
    made = config.fingerprint.to_json()
    differ = [key for key in Fingerprint.FIELDS if made[key] != job[key]]
    mismatches = [f"config was made for {key} {made[key]}, this job has {job[key]}" for key in differ]
    if "model" in differ:
        mismatches[differ.index("model")] += " (parameter names, shapes or dtypes differ)"
    if mismatches and not force:
        raise ConfigError(source or config.source, "; ".join(mismatches) + "; rerun `dpro optimize` on a run of "
                          "this job, or pass force=True (dpro-launch --force) to apply it anyway", "fingerprint")
    return mismatches


def find_config(root: str | Path, fingerprint: Fingerprint | Mapping[str, Any]) -> Path | None:
    """The newest ``config.json`` under ``root`` (searched recursively) made for ``fingerprint``.

    Files that cannot be read as configs are skipped with a warning. Newest means the latest
    modification time. Used by ``dpro-launch --apply auto``.

    Example:
        >>> find_config("runs", {"framework": "torch", "engine": engine, "world_size": 2,
        ...                      "model": "3f2a"})  # doctest: +SKIP
        PosixPath('runs/bert-bs32/analysis/config.json')
    """
    wanted = Fingerprint.coerce(fingerprint, "find_config", "fingerprint")
    candidates = []
    for path in Path(root).rglob(CONFIG_FILE):
        try:
            if path.is_file():
                candidates.append((path.stat().st_mtime_ns, str(path), path))
        except OSError:
            continue
    for _, _, path in sorted(candidates, reverse=True):
        try:
            config = read_config(path)
        except ConfigError as err:
            warnings.warn(f"dpro.config.find_config: skipped {err}", stacklevel=2)
            continue
        if config.fingerprint == wanted:
            return path
    return None

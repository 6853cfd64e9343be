"""dpro.config: the applied config's schema, reading and writing, fingerprint checks, finding configs."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import pytest

from dpro.config import (
    CONFIG_SCHEMA,
    DPRO_CONFIG,
    Baseline,
    Config,
    Explanation,
    Fingerprint,
    Predicted,
    check_fingerprint,
    find_config,
    read_config,
    write_config,
)
from dpro.errors import ConfigError, DproError

FINGERPRINT = {"framework": "torch", "engine": "torch-ddp", "world_size": 2, "model": "0123456789abcdef"}


def full_doc() -> dict:
    return {
        "schema": CONFIG_SCHEMA,
        "fingerprint": dict(FINGERPRINT),
        "baseline": {"run": "runs/bert", "step_ms": 412.0},
        "predicted": {"step_ms": 301.5, "peak_memory_bytes": 1_200_000_000},
        "knobs": {
            "torch.ddp.bucket_cap_mb": 6.5,
            "torch.ddp.first_bucket_cap_mb": None,
            "tensor_groups": [["fc3.weight", "fc3.bias"], ["fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias"]],
            "recompute": ["encoder.layers.3"],
            "gradient_compression": "fp16",
        },
        "explain": [{"knob": "torch.ddp.bucket_cap_mb", "why": "overlap the allreduce of fc3 with fc2's backward",
                     "predicted_gain_ms": 40.0},
                    {"knob": "recompute", "why": "fits the batch in memory", "predicted_gain_ms": None}],
    }


def write_doc(path: Path, doc) -> Path:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def test_round_trip(tmp_path):
    config = Config.from_json(full_doc())
    path = write_config(tmp_path / "analysis" / "config.json", config)  # makes the directory
    back = read_config(path)
    assert back == config and back.path == path
    assert json.loads(path.read_text()) == full_doc()
    assert [p.name for p in path.parent.iterdir()] == ["config.json"]  # no temp file left


def test_round_trip_of_a_minimal_config_built_in_memory(tmp_path):
    config = Config(fingerprint=Fingerprint(**FINGERPRINT), knobs={"torch.ddp.bucket_cap_mb": 4,
                                                                   "tensor_groups": [("b", "a")]})
    assert config.knobs == {"torch.ddp.bucket_cap_mb": 4.0, "tensor_groups": [["b", "a"]]}  # normalized
    assert config.baseline is None and config.predicted is None and config.explain == []
    assert read_config(write_config(tmp_path / "config.json", config)) == config


def test_nested_parts_are_dataclasses():
    config = Config.from_json(full_doc())
    assert config.fingerprint == Fingerprint("torch", "torch-ddp", 2, "0123456789abcdef")
    assert config.baseline == Baseline("runs/bert", 412.0)
    assert config.predicted == Predicted(301.5, 1_200_000_000)
    assert config.explain[1] == Explanation("recompute", "fits the batch in memory", None)
    assert DPRO_CONFIG == "DPRO_CONFIG"


def _set(doc: dict, dotted: list, value) -> dict:
    doc = copy.deepcopy(doc)
    target = doc
    for k in dotted[:-1]:
        target = target[k]
    if value is _DELETE:
        del target[dotted[-1]]
    else:
        target[dotted[-1]] = value
    return doc


_DELETE = object()
KNOB = ["knobs"]

MALFORMED = [
    # (change, the key the message names, what it says)
    (["schema"], "dpro.config/2", "schema", "not supported"),
    (["schema"], _DELETE, "schema", "no 'schema' key"),
    (["fingerprint"], _DELETE, None, "'fingerprint' is missing"),
    (["fingerprint", "world_size"], "2", "fingerprint.world_size", "positive whole number"),
    (["fingerprint", "world_size"], 0, "fingerprint.world_size", "positive whole number"),
    (["fingerprint", "world_size"], True, "fingerprint.world_size", "positive whole number"),
    (["fingerprint", "model"], _DELETE, "fingerprint", "'model' is missing"),
    (["fingerprint", "hosts"], 2, "fingerprint", "unknown key 'hosts'"),
    (["fingerprint", "engine"], "", "fingerprint.engine", "must not be empty"),
    (["knobs"], [], "knobs", "must be an object"),
    (KNOB + ["torch.ddp.bucket_size"], 4, 'knobs["torch.ddp.bucket_size"]', "unknown knob"),
    (KNOB + ["torch.ddp.bucket_cap_mb"], -1, 'knobs["torch.ddp.bucket_cap_mb"]', "positive number of MiB"),
    (KNOB + ["torch.ddp.bucket_cap_mb"], 0, 'knobs["torch.ddp.bucket_cap_mb"]', "positive number of MiB"),
    (KNOB + ["torch.ddp.bucket_cap_mb"], "6.5", 'knobs["torch.ddp.bucket_cap_mb"]', "found str '6.5'"),
    (KNOB + ["torch.ddp.bucket_cap_mb"], False, 'knobs["torch.ddp.bucket_cap_mb"]', "found bool"),
    (KNOB + ["torch.ddp.first_bucket_cap_mb"], -0.5, 'knobs["torch.ddp.first_bucket_cap_mb"]', "positive"),
    (KNOB + ["tensor_groups"], "fc3.weight", 'knobs["tensor_groups"]', "must be a list"),
    (KNOB + ["tensor_groups"], [["a"], []], 'knobs["tensor_groups"][1]', "at least one gradient"),
    (KNOB + ["tensor_groups"], [["a", 3]], 'knobs["tensor_groups"][0][1]', "must be a string"),
    (KNOB + ["tensor_groups"], [["a", "b"], ["a"]], 'knobs["tensor_groups"][1][0]',
     r"'a' appears twice \(first at knobs\[\"tensor_groups\"\]\[0\]\[0\]\)"),
    (KNOB + ["recompute"], "encoder.layers.3", 'knobs["recompute"]', "must be a list"),
    (KNOB + ["recompute"], ["a", ""], 'knobs["recompute"][1]', "must not be empty"),
    (KNOB + ["gradient_compression"], "int8", 'knobs["gradient_compression"]', "null, \"fp16\" or \"bf16\""),
    (KNOB + ["env"], {"HOROVOD_CYCLE_TIME": 2.5}, "knobs[\"env\"]['HOROVOD_CYCLE_TIME']", "must be a string"),
    (KNOB + ["env"], {"A=B": "1"}, "knobs[\"env\"]['A=B']", "not an environment variable name"),
    (["baseline", "step_ms"], -3, "baseline.step_ms", "number of ms >= 0"),
    (["baseline"], "runs/bert", "baseline", "must be an object"),
    (["predicted", "peak_memory_bytes"], 1.5, "predicted.peak_memory_bytes", "whole number"),
    (["predicted", "step_ms"], _DELETE, "predicted", "'step_ms' is missing"),
    (["explain", 0, "why"], _DELETE, "explain[0]", "'why' is missing"),
    (["explain", 1, "predicted_gain_ms"], "40", "explain[1].predicted_gain_ms", "number of ms or null"),
    (["explain"], {"knob": "x"}, "explain", "must be a list"),
    (["knob"], {}, None, "unknown key 'knob'"),
]


@pytest.mark.parametrize(("where", "value", "key", "problem"), MALFORMED,
                         ids=[f"{'.'.join(map(str, w))}={v!r}"[:60] for w, v, _, _ in MALFORMED])
def test_malformed_config_names_file_and_key(tmp_path, where, value, key, problem):
    path = write_doc(tmp_path / "config.json", _set(full_doc(), where, value))
    at = re.escape(f" ({key})") if key else ""
    with pytest.raises(ConfigError, match=re.escape(str(path)) + at + ": .*" + problem) as info:
        read_config(path)
    assert info.value.key == key and info.value.source == str(path)


@pytest.mark.parametrize(("text", "problem"), [
    ("", "the file is empty"),
    ('{"schema": "dpro.config/1",', "not valid JSON: .* line 1"),
    ('{"schema": "dpro.config/1", "knobs": {"torch.ddp.bucket_cap_mb": NaN}}',
     "not valid JSON: NaN is not a JSON number"),
    ("[1, 2]", "must be a JSON object"),
    (b"\xff\xfe{}", "not UTF-8"),
])
def test_unreadable_config(tmp_path, text, problem):
    path = tmp_path / "config.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ": " + problem):
        read_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "nope.json")) + ": no such file"):
        read_config(tmp_path / "nope.json")


def test_invalid_config_in_memory_is_refused():
    with pytest.raises(ConfigError, match=re.escape('Config (knobs["recompute"]): must be a list')) as info:
        Config(fingerprint=FINGERPRINT, knobs={"recompute": "encoder"})
    assert isinstance(info.value, DproError)


def test_write_refuses_what_is_not_a_config(tmp_path):
    with pytest.raises(TypeError, match="expected a dpro.config.Config"):
        write_config(tmp_path / "config.json", full_doc())


# ---- fingerprints ------------------------------------------------------------------------------------


def job(**changes):
    return {**FINGERPRINT, **changes}


def test_matching_fingerprint_passes():
    assert check_fingerprint(Config.from_json(full_doc()), **job()) == []


def test_mismatching_fingerprint_is_refused_with_each_difference(tmp_path):
    path = write_config(tmp_path / "config.json", Config.from_json(full_doc()))
    config = read_config(path)
    with pytest.raises(ConfigError) as info:
        check_fingerprint(config, **job(world_size=4, model="fedcba9876543210"))
    message = str(info.value)
    assert message.startswith(f"{path} (fingerprint): ")
    assert "config was made for world_size 2, this job has 4" in message
    assert "config was made for model 0123456789abcdef, this job has fedcba9876543210" in message
    assert "framework" not in message and "engine" not in message
    assert "rerun `dpro optimize` on a run of this job, or pass force=True" in message


def test_force_returns_the_mismatches():
    config = Config.from_json(full_doc())
    mismatches = check_fingerprint(config, **job(engine="horovod"), force=True)
    assert mismatches == ["config was made for engine torch-ddp, this job has horovod"]
    with pytest.raises(ConfigError, match=r"^somewhere \(fingerprint\): config was made for framework torch"):
        check_fingerprint(config, **job(framework="tf"), source="somewhere")


# ---- find_config -------------------------------------------------------------------------------------


def _place(root: Path, run: str, mtime: float, **fingerprint) -> Path:
    doc = full_doc()
    doc["fingerprint"].update(fingerprint)
    path = write_config(root / run / "analysis" / "config.json", Config.from_json(doc))
    os.utime(path, (mtime, mtime))
    return path


def test_find_config_picks_the_newest_matching(tmp_path):
    _place(tmp_path, "a", 1_000)
    newest_match = _place(tmp_path, "b", 2_000)
    _place(tmp_path, "c", 3_000, world_size=4)  # newer, for another job
    broken = tmp_path / "d" / "analysis" / "config.json"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    os.utime(broken, (4_000, 4_000))
    with pytest.warns(UserWarning, match=re.escape(str(broken)) + ": not valid JSON"):
        assert find_config(tmp_path, FINGERPRINT) == newest_match
    with pytest.warns(UserWarning, match="skipped"):
        found = find_config(tmp_path, Fingerprint(**job(world_size=4)))
    assert found == tmp_path / "c" / "analysis" / "config.json"
    assert find_config(tmp_path / "a", job(world_size=4)) is None
    assert find_config(tmp_path / "nothing-here", FINGERPRINT) is None


def test_find_config_refuses_a_bad_fingerprint(tmp_path):
    with pytest.raises(ConfigError, match=r"find_config \(fingerprint\): 'model' is missing"):
        find_config(tmp_path, {"framework": "torch", "engine": "torch-ddp", "world_size": 2})


def test_readme_knob_table_is_the_generated_one() -> None:
    """The README's knob table is dpro.config.knob_table_markdown(), so it cannot drift from the code."""
    from dpro.config import knob_table_markdown

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index("<!-- knob-table")
    table = readme[readme.index("\n", start) + 1:readme.index("<!-- /knob-table -->")].strip()
    assert table == knob_table_markdown()


@pytest.mark.parametrize(("engine", "env", "refused"), [
    ("horovod", {"HOROVOD_FUSION_THRESHOLD": "8388608", "HOROVOD_CYCLE_TIME": "2.5"}, None),
    ("mxnet-ps", {"DMLC_NUM_SERVER": "3"}, None),
    ("horovod", {"LD_PRELOAD": "/tmp/x.so"}, "LD_PRELOAD"),
    ("torch-ddp", {"HOROVOD_CYCLE_TIME": "2.5"}, "HOROVOD_CYCLE_TIME"),
    ("mxnet-ps", {"PYTHONPATH": "/tmp"}, "PYTHONPATH"),
])
def test_a_configs_env_sets_only_what_its_engines_knobs_own(engine, env, refused):
    doc = {"schema": CONFIG_SCHEMA, "fingerprint": {**FINGERPRINT, "engine": engine}, "knobs": {"env": env}}
    if refused is None:
        assert Config.from_json(doc, "c.json").knobs["env"] == env
        return
    with pytest.raises(ConfigError, match=f"only the environment variables its engine's knobs own.*{refused}"):
        Config.from_json(doc, "c.json")

"""core/ is framework-neutral: every module of the `dpro` package outside plugins/ and launch/ imports, and
`dpro analyze RUN` runs, in a process where torch, TensorFlow, Keras, MXNet, Horovod and Lightning cannot be
imported at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from run_builder import make_run

FRAMEWORKS = ("torch", "tensorflow", "keras", "tf_keras", "mxnet", "horovod", "lightning", "pytorch_lightning")

BLOCKER = f"""
import importlib.abc, sys
class NoFrameworks(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {FRAMEWORKS!r}:
            raise ImportError(f"{{name}} is blocked in this test")
        return None
sys.meta_path.insert(0, NoFrameworks())
"""

IMPORT_ALL = BLOCKER + """
import importlib, pkgutil, dpro
names = [m.name for m in pkgutil.walk_packages(dpro.__path__, "dpro.")
         if not m.name.startswith(("dpro.plugins", "dpro.launch")) and not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
assert not [m for m in sys.modules if m.split(".")[0] in FRAMEWORKS], "a framework was imported"
print(len(names))
""".replace("FRAMEWORKS", repr(FRAMEWORKS))


def test_every_core_module_imports_without_any_framework() -> None:
    proc = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip()) >= 25  # every stage's modules were walked, not an empty package


def test_dpro_analyze_runs_without_any_framework(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    code = BLOCKER + f"from dpro.cli import main\nraise SystemExit(main(['analyze', {str(run)!r}]))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "prediction error" in proc.stdout and (run / "analysis" / "replay.json").is_file()


def test_the_blocker_blocks() -> None:
    """The two tests above would pass vacuously if the blocker let torch through."""
    proc = subprocess.run([sys.executable, "-c", BLOCKER + "import torch"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "blocked in this test" in proc.stderr


def test_no_core_file_names_an_engine_outside_its_engine_module() -> None:
    """The core asks the engine registry; an engine's name and knobs are said in its own module only."""
    import dpro
    from dpro.engines import REGISTRY, get_engine

    core = Path(dpro.__file__).parent
    words = set()
    for name in REGISTRY:
        words.add(name)
        words.update(get_engine(name).knob_names())
    words.update({"horovod", "ddp"})  # the engines' own words, in any case
    offenders = []
    for path in core.rglob("*.py"):
        if "engines" in path.relative_to(core).parts:
            continue
        text = path.read_text().lower()
        offenders += [f"{path.relative_to(core)}: {w}" for w in sorted(words) if w.lower() in text]
    assert not offenders, offenders

"""dpro-launch's auto-attach: Python imports this at start-up because dpro-launch put this directory first
on ``PYTHONPATH`` for the processes it starts.

When ``DPRO_AUTO_RECORD=1`` (record), a config is to be applied (``DPRO_CONFIG``, ``DPRO_APPLY_SEARCH``) or
step times are wanted (``DPRO_STEP_TIMES``)
it asks each plugin whose framework is installed (``PLUGINS``: torch, TensorFlow, MXNet) to register its
patches with the post-import hook of ``dpro.launch.post_import``; they run when the script imports what they
patch (DDP, Lightning, ``horovod.torch.DistributedOptimizer``), and nothing is imported ahead of the script.
Then it runs the ``sitecustomize`` that would have run without this directory, if there is one. Any failure
is printed and ignored: a dpro problem never stops the user's program from starting.
"""

import importlib.machinery
import importlib.util
import os
import sys

# (plugin folder under dpro/plugins, its framework)
PLUGINS = (("torch", "torch"), ("tf", "tensorflow"), ("mxnet", "mxnet"))


def _plugin_autoattach(folder: str):  # noqa: ANN202 - a module
    """A plugin's ``autoattach.py`` loaded alone: its package imports the framework, which must wait until the
    script imports it."""
    name = f"dpro.plugins.{folder}.autoattach"
    module = sys.modules.get(name)
    if module is not None:
        return module
    plugins = importlib.util.find_spec("dpro.plugins")
    if plugins is None or not plugins.submodule_search_locations:
        return None
    path = os.path.join(list(plugins.submodule_search_locations)[0], folder, "autoattach.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _dpro_attach() -> None:
    from dpro.record import job_env  # a module of constants: cheap in every process of the job

    wanted = os.environ.get(job_env.AUTO_RECORD) == "1" or os.environ.get(job_env.CONFIG) or os.environ.get(
        job_env.APPLY_SEARCH) or os.environ.get(job_env.STEP_TIMES)
    if not wanted:
        return
    from dpro.launch.post_import import finder

    hooks = finder()
    for folder, framework in PLUGINS:
        if importlib.util.find_spec(framework) is None:
            continue
        module = _plugin_autoattach(folder)
        if module is not None:
            module.install(hooks.when_imported)


def _chain() -> None:
    """Run the next ``sitecustomize`` on sys.path (the one this file hides), as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


for _step in (_chain, _dpro_attach):
    try:
        _step()
    except Exception as _err:  # noqa: BLE001 - like site.py: report and carry on
        print(f"[dpro] sitecustomize: {_step.__name__[1:]} failed: {type(_err).__name__}: {_err}", file=sys.stderr)

"""``dpro-launch``: a drop-in for horovodrun that records the job, optimizes it and applies the result.

The manual is the docstring of ``dpro.launch.cli``. The layers, as in torchrun: ``cli.build_parser`` ->
``cli.config_from_args`` -> ``settings.LaunchConfig`` (validated) -> ``pipeline.run`` -> a launcher of
``launchers.LAUNCHERS`` (one module each: ``torch_run``, ``horovod_run``, ``tf_run``, ``mxnet_run``). Each is a
``launcher.Launcher``: its flags, options, environment and config file are its own, and the shared modules reach
them through the protocol's hooks only.
"""

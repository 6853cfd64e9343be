"""``dpro-launch``: a drop-in for horovodrun that records the job, optimizes it and applies the result.

The manual is the docstring of ``dpro.launch.cli``. The layers, as in torchrun: ``cli.build_parser`` ->
``cli.config_from_args`` -> ``settings.LaunchConfig`` (validated) -> ``pipeline.run`` -> a launcher of
``launchers.LAUNCHERS`` (one module each: ``torch_run``, ``horovod_run``, ``tf_run``, ``mxnet_run``);
``env.HOROVOD_KNOBS`` is the one table from settings to environment variables.
"""

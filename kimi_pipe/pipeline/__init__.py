"""The generic runner: the stage protocol, pipelines from `conf/pipeline/*.yaml`, progress."""

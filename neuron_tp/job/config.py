"""The options of a training, generation or serving run, each declared ONCE as a field of a
typed, frozen record (:func:`~neuron_tp.job.options.opt`: flag, parser, default, help, valid
range). The command-line parsers (:mod:`neuron_tp.cli.args`) are generated from these records;
the rest of the code reads the records. ``TrainConfig`` nests its groups of options
(``config.lora.r`` is ``--lora-r``); the parsed namespace stays flat (``args.lora_r``) and
``option_values`` lists every option by its command-line name. Built once at the entry point::

    config = TrainConfig.from_args(train_parser().parse_args(argv))

The records live in :mod:`.common_config`, :mod:`.train_config` and :mod:`.inference_config`
(one file per command); this module names them. Imports nothing beyond the standard library.
"""

from .common_config import REPO_DATA, CommonConfig
from .inference_config import GenerateConfig, ServeConfig
from .train_config import AUTO_PLAN_AXES, TrainConfig

__all__ = [
    "AUTO_PLAN_AXES",
    "REPO_DATA",
    "CommonConfig",
    "GenerateConfig",
    "ServeConfig",
    "TrainConfig",
]

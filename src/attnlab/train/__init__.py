"""Training: the loop, data, checkpoints, presets and the distributed paths.

``Trainer(load_config("run.toml")).train()`` trains any attnlab model; ``attnlab train``
is the same from the command line.
"""

from attnlab.train.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig, load_config
from attnlab.train.trainer import Trainer, TrainResult, lr_multiplier

__all__ = [
    "DataConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "load_config",
    "lr_multiplier",
]

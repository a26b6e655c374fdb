"""The reference pretraining run: config, models (GPT, Llama-style), loop."""

from samestep.train.config import Config, DataConfig, DeterminismConfig, ModelConfig, TrainConfig
from samestep.train.config_file import load_config
from samestep.train.loop import train
from samestep.train.model import GPT

__all__ = ["GPT", "Config", "DataConfig", "DeterminismConfig", "ModelConfig", "TrainConfig",
           "load_config", "train"]

"""The reference pretraining run: config, models (GPT, Llama-style), loop."""

from samestep.train.config import Config, DataConfig, DeterminismConfig, TrainConfig
from samestep.train.config_file import load_config
from samestep.train.loop import train
from samestep.train.model import GPT
from samestep.train.model_config import ModelConfig

__all__ = ["GPT", "Config", "DataConfig", "DeterminismConfig", "ModelConfig", "TrainConfig", "load_config", "train"]

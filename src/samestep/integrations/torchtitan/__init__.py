"""samestep in torchtitan's own trainer, as torchtitan runs an extension module: ``--module
samestep.integrations.torchtitan --config <a torchtitan config function>`` (``config_registry``) builds a
``SamestepTrainer`` (``trainer``) on that config, fed by ``CorpusLoader`` (``data``) unless the config names
another data loader. docs/api.md, "torchtitan"."""

from samestep.integrations.torchtitan.data import ByteTokenizer, CorpusLoader
from samestep.integrations.torchtitan.trainer import Samestep, SamestepTrainer

__all__ = ["ByteTokenizer", "CorpusLoader", "Samestep", "SamestepTrainer"]

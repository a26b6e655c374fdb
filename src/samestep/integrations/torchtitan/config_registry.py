"""torchtitan's config functions under ``--module samestep.integrations.torchtitan``: each of torchtitan's
language-model config functions (``llama3_debugmodel``, ``qwen3_...``), by its own name, as a
``SamestepTrainer.Config`` fed by samestep's embedded corpus (``CorpusLoader``, ``ByteTokenizer``: no download);
``samestep_config(config)`` does the same to a config of one's own."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from torchtitan.trainer import Trainer

from samestep.integrations.torchtitan.data import ByteTokenizer, CorpusLoader
from samestep.integrations.torchtitan.trainer import Samestep, SamestepTrainer

__all__ = ["samestep_config"]

_MODELS = ("llama3", "qwen3", "qwen3_5", "deepseek_v3", "gpt_oss", "kimi_k2_7")  # torchtitan's language models


def samestep_config(config: Trainer.Config, *, corpus: bool = True, **options: Any) -> SamestepTrainer.Config:
    """``config`` (a torchtitan ``Trainer.Config``) as a ``SamestepTrainer.Config`` with ``options``
    (``Samestep``'s fields), its ``debug.seed`` 0 where unset. ``corpus``: read samestep's embedded corpus as
    bytes instead of the config's data loader and tokenizer (whose files a torchtitan checkout holds)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    if corpus:
        fields |= {"dataloader": CorpusLoader.Config(), "tokenizer": ByteTokenizer.Config()}
    if fields["debug"].seed is None:  # torchtitan's default draws one per run
        fields["debug"] = dataclasses.replace(fields["debug"], seed=0)
    return SamestepTrainer.Config(**fields, samestep=Samestep(**options))


def __getattr__(name: str) -> Any:
    """torchtitan's config function ``name`` (from its language models' registries), made a samestep one."""
    if name.startswith("__"):
        raise AttributeError(name)
    for model in _MODELS:
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError:
            continue
        function = getattr(registry, name, None)
        if callable(function):

            def config() -> SamestepTrainer.Config:
                return samestep_config(function())

            config.__name__ = name
            config.__doc__ = f"torchtitan's {model} config {name}, on samestep's numerical path."
            return config
    raise AttributeError(f"{name!r} is none of torchtitan's language-model config functions ({', '.join(_MODELS)})")

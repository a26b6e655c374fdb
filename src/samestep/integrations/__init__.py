"""samestep inside the training frameworks people use: a callback each for PyTorch Lightning
(``samestep.integrations.lightning``) and the Hugging Face ``transformers`` Trainer
(``samestep.integrations.huggingface``). Each module imports its framework only when it is imported."""

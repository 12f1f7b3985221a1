"""From a path or a name to a running model: checkpoints (GGUF, safetensors), the tokenizer, generation defaults.
Imports backends and the rooms below it."""

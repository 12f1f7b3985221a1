"""What is on disk, read and checked: model and drafter configs, GGUF files and their tensor names, ggml's quant
blocks. The bottom room: it imports only the engine's contract (types, errors, paths, limits)."""

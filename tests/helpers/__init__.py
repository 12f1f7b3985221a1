"""What several test modules share: tiny checkpoints and their configs, tokenizers, the decode loop as the scheduler
runs it, the embedded engine's factory. Test modules import from here, never from one another
(tests/test_layers.py)."""

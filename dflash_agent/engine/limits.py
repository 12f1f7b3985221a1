"""The row counts a step is sized by, each with the reason for its value: how many new tokens one call, one block or
one chunk takes. The Triton kernels' tiles, which the engine follows, live with the kernels (kernels.dispatch:
SPLIT_ROWS, VERIFY_ROWS; kernels.attention: BLOCKED_ROWS), since the kernels import nothing from the engine.
Measurements behind these values: docs/benchmarks.md."""

from ..kernels.dispatch import VERIFY_ROWS

# The most rows one C call takes: decode rows, verification blocks of up to 64 drafts, a prompt's last short chunk.
# Past it the eager path's GEMMs win (they dequantize each weight once per forward, however many rows share it).
MAX_ROWS = 128
# Greedy steps of this many rows and more screen the LM head (backends.cpu: CpuDot.norm_head_argmax): a block's rows
# share the screen's pass over the head, which a lone decode row would stream for nothing.
SCREEN_ROWS = 2
# Activation rows from which a float32 GEMM on dequantized weights beats the C integer dot (model.packed).
GEMM_ROWS = 32
# Prompt chunks: this many tokens a forward bounds prefill attention memory on long prompts (decode.speculative).
PREFILL_CHUNK = 512
# Prompt chunks shorter than this go through the C decode layers in blocks of StepRunner.step_rows: the prefill GEMM
# dequantizes every weight per forward, a fixed cost that such a chunk's rows do not repay.
SHORT_PREFILL = 128
# Queued drafter features are fed at most this many rows late, so the queue stays small.
FEED_EVERY = 256
# A forward of up to this many tokens may be rolled back (a speculative block plus its bonus token): the sliding
# layers' rings keep that many slots past the window.
DEFAULT_SLACK = 16
# Where the target verifies prompt lookup's long drafts (the CPU's C layers): 48 more slots per sliding layer.
LOOKUP_SLACK = 64
# CUDA graph buckets of a step's rows (backends.cuda), up to a verification tile, as the memory plan's logits rows.
BUCKETS = (1, 2, 4, 8, VERIFY_ROWS)

"""Row counts that more than one room of the engine sizes by."""

# The most rows one C call takes: decode rows, verification blocks of up to 64 drafts, a prompt's last short chunk.
# Past it the eager path's GEMMs win (they dequantize each weight once per forward, however many rows share it).
MAX_ROWS = 128

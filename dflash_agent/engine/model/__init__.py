"""The math: Gemma's layers and its eager forward (the reference the other paths are held to), the DFlash and MTP
drafters, packed and quantized linear weights. Imports cache and formats."""

"""Our GGUF header reader against gguf-py's GGUFReader on the embedded model, and on broken files."""

import numpy as np
import pytest
from gguf import GGUFReader

from dflash_agent.engine.formats.gguf import GGUFError, read_gguf


def test_metadata_and_tensors_match_gguf_py(embedded_gguf):
    ours = read_gguf(embedded_gguf)
    ref = GGUFReader(embedded_gguf)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):  # gguf-py's own pseudo-fields for the header
            continue
        expected, got = field.contents(), ours.fields[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        if isinstance(expected, float) or (isinstance(expected, list) and expected and isinstance(expected[0], float)):
            np.testing.assert_allclose(got, expected, rtol=0, atol=0)
        else:
            assert got == expected, key
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == t.tensor_type
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(mine.data.reshape(-1), t.data.reshape(-1).view(np.uint8)), t.name


def test_not_a_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a model at all")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(path)


def test_truncated(embedded_gguf, tmp_path):
    path = tmp_path / "cut.gguf"
    with open(embedded_gguf, "rb") as src:
        path.write_bytes(src.read(5_000_000))
    with pytest.raises(GGUFError, match="truncated|past the end"):
        read_gguf(path)


def test_missing(tmp_path):
    with pytest.raises(GGUFError, match="not found"):
        read_gguf(tmp_path / "nope.gguf")

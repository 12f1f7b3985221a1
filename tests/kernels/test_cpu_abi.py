"""The ctypes mirror of cpu_dot.h's structs is held to the C layout field by field (names, offsets, sizes), so a field
moved, renamed, retyped or added on one side only is refused at load, not called with misread memory; and the
mirror's structs are filled by field name only, so a field moved on both sides cannot take another's value."""

import ctypes

import pytest

from dflash_agent.kernels.cpu import cpu_dot


@pytest.fixture(scope="module")
def layouts():
    path = cpu_dot.prebuilt("generic")
    if path is None:
        pytest.skip("no generic build installed")
    return cpu_dot.library_fields(ctypes.CDLL(str(path)))


def test_the_mirror_matches_every_field_of_the_built_library(layouts):
    assert cpu_dot.abi_mismatches(layouts) == []
    assert [len(fields) for fields in layouts] == [len(s._fields_) for s in cpu_dot.ABI_STRUCTS]


def _mirror(fields):
    return type("Matrix", (ctypes.Structure,), {"_fields_": fields})


def test_two_fields_of_one_type_swapped_are_refused(layouts):
    fields = list(cpu_dot.Matrix._fields_)
    group, bits = fields.index(("group", ctypes.c_int64)), fields.index(("bits", ctypes.c_int64))
    fields[group], fields[bits] = fields[bits], fields[group]  # same sizes: the struct's size cannot tell
    swapped = _mirror(fields)
    assert ctypes.sizeof(swapped) == ctypes.sizeof(cpu_dot.Matrix)
    structs = (swapped, *cpu_dot.ABI_STRUCTS[1:])
    assert cpu_dot.abi_mismatches(layouts, structs) == [
        "Matrix.bits at offset 32 size 8, C has offset 40 size 8",
        "Matrix.group at offset 40 size 8, C has offset 32 size 8",
    ]


def test_a_field_added_renamed_or_retyped_on_one_side_is_refused(layouts):
    fields = list(cpu_dot.Screen._fields_)
    renamed = [("scale" if name == "d" else name, kind) for name, kind in fields]
    retyped = [(name, ctypes.c_int32 if name == "k" else kind) for name, kind in fields]
    added = fields + [("extra", ctypes.c_int64)]
    for mirror, expected in [
        (renamed, ["Screen lacks the C field d", "Screen.scale is not in the C struct"]),
        (retyped, ["Screen.k at offset 40 size 4, C has offset 40 size 8"]),
        (added, ["Screen.extra is not in the C struct"]),
    ]:
        screen = type("Screen", (ctypes.Structure,), {"_fields_": mirror})
        assert cpu_dot.abi_mismatches(layouts, (*cpu_dot.ABI_STRUCTS[:3], screen)) == expected


def test_a_library_whose_layout_disagrees_is_not_loaded(monkeypatch, caplog):
    path = cpu_dot.prebuilt("generic")
    if path is None:
        pytest.skip("no generic build installed")
    assert cpu_dot.open_library(path) is not None
    fields = list(cpu_dot.LayerCache._fields_)
    fields[5], fields[6] = fields[6], fields[5]  # n_keys and window, both int64
    reordered = type("LayerCache", (ctypes.Structure,), {"_fields_": fields})
    monkeypatch.setattr(cpu_dot, "ABI_STRUCTS", (*cpu_dot.ABI_STRUCTS[:2], reordered, cpu_dot.ABI_STRUCTS[3]))
    assert cpu_dot.open_library(path) is None
    assert "LayerCache.n_keys" in caplog.text and "LayerCache.window" in caplog.text


def test_the_structs_are_filled_by_field_name_only():
    with pytest.raises(TypeError):
        cpu_dot.Matrix(1, 0, 2)  # a positional q, qh, d binds by place, not by name
    with pytest.raises(AttributeError):
        cpu_dot.LayerCache(n_key=3)
    layer = cpu_dot.LayerWeights(hidden=8, eps=0.5)
    assert (layer.hidden, layer.eps, layer.heads) == (8, 0.5, 0)
    with pytest.raises(AttributeError):
        layer.hiden = 9  # a misspelt field: C would never see it

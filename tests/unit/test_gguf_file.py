"""models.gguf_file against the ``gguf`` package's own reader, on files its writer makes: the same metadata, the same
tensor table, the same dequantized bits for every block format the package can write; and clear errors for files that
are not GGUF or are cut short."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from modeld_cell.models.gguf_file import GGUFError, GGUFFile  # noqa: E402

QTYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"]


def _write(path, qtypes=QTYPES, rows=3, cols=64, alignment=None):
    """A file with every metadata value type and one [rows, cols] tensor per block format (odd row count)."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("general.name", "tiny café")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_array("t.strings", ["a", "", "日本語", "Ġthe"] * 50)
    w.add_array("t.ints", list(range(-3, 300)))
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_array("t.bools", [True, False, True])
    rng = np.random.default_rng(0)
    for q in qtypes:
        x = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        qt = gguf.GGMLQuantizationType[q]
        w.add_tensor(f"blk.{q}.weight", gguf.quants.quantize(x, qt), raw_shape=None, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64], ids=["align-default", "align-64"])
def test_fields_and_tensors_match_the_gguf_package(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    _write(path, alignment=alignment)
    ref = gguf.GGUFReader(str(path))
    with GGUFFile(path) as f:
        for key, field in ref.fields.items():
            if key.startswith("GGUF."):                       # the reader's own header entries
                continue
            assert f.fields[key] == field.contents(), key
        assert f.fields["t.true"] is True and f.fields["t.false"] is False
        assert [t.name for t in f.tensors] == [t.name for t in ref.tensors]
        for mine, theirs in zip(f.tensors, ref.tensors, strict=True):
            assert mine.type_name == theirs.tensor_type.name
            assert mine.shape == tuple(int(x) for x in theirs.shape)
            assert mine.torch_shape == (3, 64)
            assert mine.offset == theirs.data_offset and mine.nbytes == theirs.n_bytes
            assert np.array_equal(f.raw(mine), np.asarray(theirs.data).view(np.uint8).reshape(-1))
            want = gguf.quants.dequantize(theirs.data, theirs.tensor_type).reshape(3, 64)
            got = f.dequantize(mine, rows_per_call=2)         # calls that cut the rows unevenly
            assert got.dtype == np.float32 and got.shape == (3, 64)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), mine.name   # bit for bit


def test_not_a_gguf_file_is_refused_with_its_path(tmp_path):
    for name, data in (("empty.gguf", b""), ("text.gguf", b"hello, this is not a model file at all")):
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(GGUFError, match=f"{name}: not a GGUF file"):
            GGUFFile(p)


def test_a_cut_short_file_is_refused(tmp_path):
    path = tmp_path / "t.gguf"
    _write(path, qtypes=["F32", "Q4_1"])
    data = path.read_bytes()
    ref = gguf.GGUFReader(str(path))
    header_end = ref.tensors[0].data_offset
    (tmp_path / "head.gguf").write_bytes(data[: header_end // 2])       # cut inside the metadata
    with pytest.raises(GGUFError, match="truncated GGUF header"):
        GGUFFile(tmp_path / "head.gguf")
    (tmp_path / "data.gguf").write_bytes(data[:-10])                     # cut inside the last tensor
    with pytest.raises(GGUFError, match="runs past the end of the file"):
        GGUFFile(tmp_path / "data.gguf")


def test_an_unsupported_version_is_refused(tmp_path):
    path = tmp_path / "t.gguf"
    _write(path, qtypes=["F32"])
    data = bytearray(path.read_bytes())
    data[4:8] = (1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="GGUF version 1 is not supported"):
        GGUFFile(path)
    data[4:8] = (3).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="big-endian"):
        GGUFFile(path)

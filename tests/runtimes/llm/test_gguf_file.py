"""Our GGUF reader against gguf-py's on the same files: the same metadata and the same tensors, byte for byte."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from runtimes.llm.gguf_file import QUANT_BLOCKS, GGUFFile
from tests.runtimes.llm.conftest import SMOLLM2_FILE, smollm2_dir
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf

_PSEUDO_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # gguf-py's own, not in the file's table


def _assert_same(path) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items() if k not in _PSEUDO_KEYS}
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.tensor_type, mine.shape) == (ref.tensor_type, tuple(int(d) for d in ref.shape)), ref.name
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, ref.name
        assert np.array_equal(mine.data, ref.data), ref.name


def test_smollm2_reads_the_same():
    _assert_same(smollm2_dir() / SMOLLM2_FILE)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_a_written_file_reads_the_same(tmp_path, qtype):
    _assert_same(write_gguf(hf_model(TinySpec()), tmp_path / "tiny.gguf", qtype))


def test_the_block_sizes_are_the_formats_own():
    """Our table of block-quantized types (the reader's, so that it need not import gguf-py) against gguf-py's."""
    sizes = {int(kind): size for kind, size in gguf.GGML_QUANT_SIZES.items()}
    blocked = {kind: size for kind, size in sizes.items() if size[0] > 1 or kind == gguf.GGMLQuantizationType.BF16}
    assert blocked == QUANT_BLOCKS


def test_reading_a_file_does_not_import_gguf_py(tmp_path):
    import subprocess
    import sys

    path = write_gguf(hf_model(TinySpec()), tmp_path / "tiny.gguf", "Q8_0")
    code = ("import sys; from runtimes.llm.gguf_file import GGUFFile; "
            f"f = GGUFFile({str(path)!r}); [t.data for t in f.tensors]; print('gguf' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_not_a_gguf_file_and_a_cut_one(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(tmp_path / "x.gguf")
    whole = write_gguf(hf_model(TinySpec()), tmp_path / "tiny.gguf")
    for cut in (100, 1000, whole.stat().st_size - 10):  # in the metadata, in the tensor table, in the data
        (tmp_path / "cut.gguf").write_bytes(whole.read_bytes()[:cut])
        with pytest.raises(ValueError, match="truncated or corrupt GGUF file"):
            GGUFFile(tmp_path / "cut.gguf")

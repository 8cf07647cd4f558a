"""``models/gguf_blocks``: the output projection's Q6_K blocks read from a GGUF exactly as the
file holds them (``output.weight``, else the tied ``token_embd.weight``), nothing for another
type, and kept in a converted folder without touching its weights hash."""

from __future__ import annotations

import numpy as np
import torch

from kvreuse.models import gguf_blocks
from kvreuse.models.quant.q6k_linear import BLOCK_BYTES


def _gguf(path, tensors: dict[str, tuple[np.ndarray, object]]):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, kind) in tensors.items():
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_the_output_projections_q6_k_blocks(tmp_path):
    import gguf

    q6 = gguf.GGMLQuantizationType.Q6_K
    rows = np.random.RandomState(0).randint(0, 256, (32, 2 * BLOCK_BYTES)).astype(np.uint8)
    other = np.random.RandomState(1).randint(0, 256, (32, 2 * BLOCK_BYTES)).astype(np.uint8)
    f32 = np.zeros((32, 512), dtype=np.float32)
    tied = _gguf(tmp_path / "tied.gguf", {"token_embd.weight": (rows, q6)})
    assert torch.equal(gguf_blocks.output_blocks_of(tied), torch.from_numpy(rows))
    untied = _gguf(tmp_path / "untied.gguf", {"token_embd.weight": (other, q6), "output.weight": (rows, q6)})
    assert torch.equal(gguf_blocks.output_blocks_of(untied), torch.from_numpy(rows))
    plain = _gguf(tmp_path / "f32.gguf", {"token_embd.weight": (f32, gguf.GGMLQuantizationType.F32)})
    assert gguf_blocks.output_blocks_of(plain) is None
    assert gguf_blocks.output_blocks_of(tmp_path / "missing.gguf") is None


def test_a_folder_keeps_them_beside_the_weights(tmp_path):
    from kvreuse.models.store import _weight_files

    assert gguf_blocks.load(tmp_path) is None
    (tmp_path / "model.safetensors").write_bytes(b"")
    blocks = torch.randint(0, 256, (16, BLOCK_BYTES), dtype=torch.uint8)
    gguf_blocks.save(tmp_path, blocks)
    assert torch.equal(gguf_blocks.load(tmp_path), blocks)
    assert [f.name for f in _weight_files(tmp_path)] == ["model.safetensors"]  # not hashed as a weight


def test_an_unreadable_blocks_file_is_no_blocks(tmp_path):
    """A corrupt, truncated or foreign ``gguf_blocks.st`` loads as no blocks (the output
    projection is requantized as without them), never as an error that stops the model load."""
    from safetensors.torch import save_file

    (tmp_path / gguf_blocks.FILE).write_bytes(b"not a safetensors file")
    assert gguf_blocks.load(tmp_path) is None
    gguf_blocks.save(tmp_path, torch.randint(0, 256, (16, BLOCK_BYTES), dtype=torch.uint8))
    whole = (tmp_path / gguf_blocks.FILE).read_bytes()
    (tmp_path / gguf_blocks.FILE).write_bytes(whole[: len(whole) // 2])  # truncated
    assert gguf_blocks.load(tmp_path) is None
    save_file({"output.q6_k": torch.zeros(16, BLOCK_BYTES)}, str(tmp_path / gguf_blocks.FILE))  # float, not bytes
    assert gguf_blocks.load(tmp_path) is None
    (tmp_path / gguf_blocks.FILE).unlink()
    (tmp_path / gguf_blocks.FILE).mkdir()  # not a file at all
    assert gguf_blocks.load(tmp_path) is None

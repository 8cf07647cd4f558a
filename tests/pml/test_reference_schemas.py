"""Issue 14, item 4: every schema in Prompt Cache's ``examples/`` registers through
``LLM.register_schema`` (tiny Llama, the default model's SmolLM2 tokenizer), and a module
holding Python comparisons tokenizes to exactly its text."""

from __future__ import annotations

import pytest

from kvreuse import LLM
from tests.pml.pml_helpers import SCHEMAS, encode

REFERENCE = SCHEMAS / "reference"

# file -> (schema name, modules registered, schema length in positions)
EXPECTED = {
    "code_generation_bookstore.xml": ("code-generation-bookstore", 6, 860),
    "code_generation_game.xml": ("code-generation-game", 6, 5436),
    "parameterized_prompts.xml": ("travel", 12, 238),
    "persona_generation.xml": ("persona", 30, 1340),
    "personalization-education.xml": ("personalization-education", 31, 1299),
}


def make(tiny_llama) -> LLM:
    return LLM(loaded=tiny_llama, kv_cache_memory_gib=0.05, block_size=16, max_model_len=16384)


def test_every_reference_example_is_shipped():
    assert sorted(p.name for p in REFERENCE.glob("*.xml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_schema_registers(tiny_llama, name):
    info = make(tiny_llama).register_schema((REFERENCE / name).read_text(encoding="utf-8"))
    schema_name, modules, length = EXPECTED[name]
    assert (info.name, len(info.modules), info.computed, info.length) == (schema_name, modules, modules, length)


def test_a_module_with_python_comparisons_tokenizes_to_exactly_its_text(tiny_llama):
    raw = (REFERENCE / "code_generation_game.xml").read_text(encoding="utf-8")
    llm = make(tiny_llama)
    llm.register_schema(raw)
    module = llm.engine.modules.schemas["code-generation-game"].module("map.py")
    start = raw.index('<module name="map.py">') + len('<module name="map.py">')
    body = raw[start : raw.index("</module>", start)].strip()
    assert "        return (0 <= position[0] < self.grid_size and\n" in body
    # the module's stored ids are the tokenizer's ids of its text (after its "\n" lead), and decode back to it
    assert module.token_ids == tuple(encode(llm.tokenizer, "\n" + body))
    assert llm.tokenizer.decode(list(module.token_ids)) == "\n" + body

"""The tekken tokenizer's cached vocabulary: the ids mistral-common gives, on real text, for both
tekken files it ships; a corrupt or unwritable cache; and a start that skips mistral-common."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mistral_common.tokens.tokenizers.tekken import Tekkenizer

from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.tokenizer.tekken_vocab import PROBE, cache_name
from megatron.apertus.tokenizer.tokenizers import TekkenTokenizer, bundled_tekken_path
from tests.conftest import REPO

TEKKEN_FILES = ["tekken_240718.json", "tekken_240911.json"]


@pytest.fixture(scope="module", params=TEKKEN_FILES)
def tekken(request, tmp_path_factory):
    """(path, mistral-common's tokenizer, cache directory filled by a first load)."""
    path = bundled_tekken_path(request.param)
    cache = tmp_path_factory.mktemp("cache")
    TekkenTokenizer(path, cache_dir=cache)
    return path, Tekkenizer.from_file(str(path)), cache


def test_cached_vocabulary_encodes_as_mistral_common(tekken):
    path, reference, cache = tekken
    assert [p.name for p in cache.iterdir()] == [cache_name(path)]
    ours = TekkenTokenizer(path, cache_dir=cache)  # from the cache
    for text in [PROBE, *embedded_documents()[:40]]:
        assert ours.encode(text) == reference.encode(text, bos=False, eos=False)
    assert (ours.vocab_size, ours.bos, ours.eod, ours.pad) == (
        reference.n_words,
        reference.bos_id,
        reference.eos_id,
        reference.pad_id,
    )
    assert ours.special_ids() == list(range(reference.num_special_tokens))
    assert ours.decode(ours.encode(PROBE)) == PROBE
    assert ours.special_piece(ours.bos) == "<s>"


def corrupt(cache_file) -> None:
    with np.load(cache_file, allow_pickle=False) as arrays:
        header, lengths, blob = arrays["header"], arrays["lengths"], arrays["blob"].copy()
    blob[1000] ^= 0xFF
    np.savez(cache_file, header=header, lengths=lengths, blob=blob)


def test_a_corrupt_cache_is_ignored_and_rewritten(tekken, tmp_path):
    path, reference, cache = tekken
    cache_file = tmp_path / cache_name(path)
    cache_file.write_bytes((cache / cache_name(path)).read_bytes())
    corrupt(cache_file)
    damaged = cache_file.read_bytes()
    ours = TekkenTokenizer(path, cache_dir=tmp_path)
    assert ours.encode(PROBE) == reference.encode(PROBE, bos=False, eos=False)
    assert cache_file.read_bytes() == (cache / cache_name(path)).read_bytes() != damaged

    cache_file.write_bytes(damaged[: len(damaged) // 2])  # a truncated file
    assert TekkenTokenizer(path, cache_dir=tmp_path).encode(PROBE) == ours.encode(PROBE)
    assert not list(tmp_path.glob("*.tmp*"))


def test_an_unwritable_cache_directory_only_costs_speed(tekken, tmp_path):
    path, reference, _ = tekken
    (tmp_path / "file").write_text("not a directory")
    ours = TekkenTokenizer(path, cache_dir=tmp_path / "file" / "cache")
    assert ours.encode(PROBE) == reference.encode(PROBE, bos=False, eos=False)


def test_a_warm_start_encodes_without_loading_mistral_commons_tokenizer(tekken):
    path, reference, cache = tekken
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from megatron.apertus.tokenizer.tokenizers import TekkenTokenizer\n"
        f"tok = TekkenTokenizer({str(path)!r}, cache_dir=Path({str(cache)!r}))\n"
        "ids = tok.encode(sys.stdin.read())\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('mistral_common.', 'pydantic')))\n"
        "print(json.dumps([ids, loaded]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=PROBE,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
        check=True,
    )
    ids, loaded = json.loads(proc.stdout)
    assert ids == reference.encode(PROBE, bos=False, eos=False)
    assert loaded == []

"""Tokenizers: a Hugging Face tokenizer.json tokenizes as transformers does, and every tool
reads either kind through maxtrain.tokenizers.

The oracle is tests/fixtures/hf/*/generate.json: the ids transformers' AutoTokenizer gave each
prompt (tools/make_hf_fixtures.py generate), with the model's special tokens applied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import support

from maxtrain.data.shards import read_shard, write_shards
from maxtrain.tokenizers import (
    DEFAULT_TOKENIZER,
    TokenizerError,
    copy_tokenizer_files,
    load_tokenizer,
)

FIXTURES = support.FIXTURES / "hf"
WITH_TOKENIZER = ["llama_gqa_untied_sharded", "qwen3_gqa4_untied_v5"]


@pytest.mark.parametrize("case", WITH_TOKENIZER)
def test_tokenizer_json_encodes_as_transformers(case):
    tokenizer = load_tokenizer(FIXTURES / case)
    oracle = json.loads((FIXTURES / case / "generate.json").read_text())["cases"]
    prompts = [c["prompt"] for c in oracle]
    assert tokenizer.encode(prompts, add_special_tokens=True) == [c["prompt_ids"] for c in oracle]
    # BOS only where the tokenizer's post-processor adds one (Llama), never without asking
    plain = tokenizer.encode(prompts)
    starts_with_bos = [c["prompt_ids"][0] == tokenizer.bos_id for c in oracle]
    assert all(starts_with_bos) == (case.startswith("llama"))
    assert all(tokenizer.bos_id not in ids for ids in plain)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, 3)
    assert [tokenizer.decode(ids) for ids in plain] == prompts
    assert (
        tokenizer.vocab_size
        == json.loads((FIXTURES / case / "config.json").read_text())["vocab_size"]
    )


def test_special_tokens_come_from_the_models_files(tmp_path):
    """tokenizer_config.json's token strings win over the ids of generation_config.json and
    config.json, as in transformers; with none of them there is no EOS, which is refused."""
    model = Path(shutil.copytree(FIXTURES / WITH_TOKENIZER[0], tmp_path / "m"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<pad>"}))
    tokenizer = load_tokenizer(model / "tokenizer.json")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 3, 3)
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "nope"}}))
    with pytest.raises(TokenizerError, match="eos_token 'nope' is not in .*vocabulary"):
        load_tokenizer(model)
    (model / "tokenizer_config.json").unlink()
    (model / "generation_config.json").unlink()
    (model / "config.json").unlink()  # it names an eos_token_id too
    with pytest.raises(TokenizerError, match="has no EOS token"):
        load_tokenizer(model)
    (model / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="is not a Hugging Face tokenizer.json"):
        load_tokenizer(model)
    with pytest.raises(TokenizerError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)


def test_a_directory_picks_the_kind_and_a_copy_keeps_it(tmp_path):
    copied = copy_tokenizer_files(FIXTURES / WITH_TOKENIZER[0], tmp_path)
    assert copied == ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    assert type(load_tokenizer(tmp_path)).__name__ == "HuggingFaceTokenizer"
    (tmp_path / "sp").mkdir()
    shutil.copyfile(DEFAULT_TOKENIZER, tmp_path / "sp" / "tokenizer.model")
    sentencepiece = load_tokenizer(tmp_path / "sp")
    assert type(sentencepiece).__name__ == "SentencePieceTokenizer"
    assert sentencepiece.encode(["x = 1"], add_special_tokens=True)[0][0] == sentencepiece.bos_id


def test_prepared_data_from_a_tokenizer_json(tmp_path):
    """tools/prepare_data.py's writer takes a Hugging Face tokenizer like a sentencepiece
    one:
    each record is the document's ids and the tokenizer's EOS."""
    tokenizer = load_tokenizer(FIXTURES / WITH_TOKENIZER[1])
    docs = ["the cat sat on the mat.", "hello world"]
    metadata = write_shards(docs, tokenizer, tmp_path / "out")
    records = [r.tolist() for r in read_shard(tmp_path / "out" / "shard-00000.arrayrecord")]
    assert records == [ids + [2] for ids in tokenizer.encode(docs)]
    assert (metadata["eos_id"], metadata["vocab_size"]) == (2, 96)

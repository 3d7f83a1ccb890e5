"""GRPO's prompt source (maxtrain/data/prompts.py): the held-out split, exact resume, and bad
lines named by file and line."""

import json

import pytest

from maxtrain import config as config_lib
from maxtrain.data import chat
from maxtrain.data.corpora.sums import problems
from maxtrain.data.errors import DataError
from maxtrain.data.prompts import PromptStream


def _cfg(tmp_path, lines):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml",
        [
            "model_name=tiny", "model.vocab_size=1024", "train.task=grpo",
            f"data.sources=[{{name: sums, path: {path}, format: prompts}}]",
            "data.eval_fraction=0.25", "train.global_batch_size=12", "train.grpo.group_size=4",
            f"run.output_dir={tmp_path}",
        ],
    )  # fmt: skip


def test_prompts_split_resume_exactly_and_cover_each_epoch(tmp_path):
    rows = problems(30, 1, 0)
    tokenizer = chat.load_tokenizer(None)
    stream = PromptStream(_cfg(tmp_path, rows), tokenizer)
    assert stream.per_step == 3
    train = {p.text for p in stream.train}
    assert train.isdisjoint(p.text for p in stream.held_out) and stream.held_out
    assert len(train) + len(stream.held_out) == 30
    epoch = [p.text for _ in range(len(stream.train)) for p in next(stream)][: len(train)]
    assert sorted(epoch) == sorted(train)  # every training prompt once per epoch
    state = stream.get_state()
    ahead = [[p.text for p in next(stream)] for _ in range(5)]
    resumed = PromptStream(_cfg(tmp_path, rows), tokenizer)
    resumed.set_state(state)
    assert [[p.text for p in next(resumed)] for _ in range(5)] == ahead
    first = stream.train[0]
    assert first.tokens[0] == tokenizer.eos_id  # a prompt starts as a document does


def test_a_bad_prompt_line_is_named(tmp_path):
    with pytest.raises(DataError, match=r"p.jsonl:2: expected string fields 'prompt'"):
        PromptStream(
            _cfg(tmp_path, [{"prompt": "a", "completion": "b"}, {"prompt": "a"}]),
            chat.load_tokenizer(None),
        )

"""Fine-tuning data: chat conversations and preference pairs from JSONL, rendered with a chat
template and tokenized, each token flagged with whether the loss counts it.

Inputs, one JSON object per line:
  chat        {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
              or {"prompt": str, "completion": str} (a user turn and the assistant's answer)
  preference  {"prompt": str | messages, "chosen": str, "rejected": str}

The template is Jinja, as Hugging Face tokenizers ship it (`chat_template` in
tokenizer_config.json), or a built-in named in BUILTIN_TEMPLATES. The template sees `messages`,
`add_generation_prompt`, and empty `bos_token`/`eos_token`: special tokens are ids, not text,
and the conversation's EOS id is appended after rendering (and trained: it teaches the model
to stop).

Which tokens carry loss. The text an assistant turn adds is found by rendering prefixes of the
conversation: the render of the turns before it with the generation prompt, then with the turn
itself. The difference is the assistant's text (its end-of-turn marker included); everything
else (system, user, the template's headers) is context without loss. A template whose renders
are not prefixes of each other (one that rewrites earlier turns) is refused. The pieces are
tokenized one by one, so a token never straddles a loss boundary; the tokenizer's handling of
a piece's first character can make that differ slightly from tokenizing the whole text.

The tokenizer (maxtrain/tokenizers: sentencepiece or a Hugging Face tokenizer.json) is
loaded only by `load_tokenizer` below; with a Hugging Face tokenizer directory, data.tokenizer
and data.chat_template can both name it (tokenizer.json and tokenizer_config.json).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from maxtrain import tokenizers
from maxtrain.data import packing
from maxtrain.data.errors import DataError

BUILTIN_TEMPLATES = {
    # ChatML (Qwen and others): <|im_start|>role\ncontent<|im_end|>\n
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # The turns' text and nothing else: a prompt and its completion as one document, for a
    # base model's tasks (GRPO's warm start on maxtrain/data/assets/sums_sft.jsonl)
    "text": "{% for m in messages %}{{ m.content }}{% endfor %}",
    # Plain text, for tokenizers without chat markers: "User: ...\n\nAssistant: ...\n\n"
    "plain": (
        "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant: {% endif %}"
    ),
}
ROLES = ("system", "user", "assistant")
Messages = list[dict[str, str]]


def load_tokenizer(path: str | None) -> tokenizers.Tokenizer:
    """The tokenizer chat data is encoded with: data.tokenizer (a sentencepiece model, a
    tokenizer.json, or a directory holding one), or the committed default."""
    return tokenizers.load_tokenizer(path or tokenizers.DEFAULT_TOKENIZER)


class ChatTemplate:
    """A Jinja chat template, rendered in a sandbox as Hugging Face tokenizers do."""

    def __init__(self, source: str, name: str):
        import jinja2.sandbox  # imported on use: only fine-tuning needs it

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise DataError(f"chat template {name}: {e}") from None
        self.name = name

    def render(self, messages: Messages, add_generation_prompt: bool) -> str:
        import jinja2

        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token="",
                eos_token="",
            )
        except jinja2.TemplateError as e:
            raise DataError(f"chat template {self.name}: {e}") from None

    def pieces(self, messages: Messages) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, carries loss) pieces, adjacent flags merged."""
        pieces: list[tuple[str, bool]] = []
        done = ""
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt = self.render(messages[:i], add_generation_prompt=True)
                pieces.append((self._extension(done, prompt), False))
                done = prompt
            full = self.render(messages[: i + 1], add_generation_prompt=False)
            pieces.append((self._extension(done, full), message["role"] == "assistant"))
            done = full
        merged: list[tuple[str, bool]] = []
        for text, loss in pieces:
            if merged and merged[-1][1] == loss:
                merged[-1] = (merged[-1][0] + text, loss)
            elif text:
                merged.append((text, loss))
        return merged

    def _extension(self, before: str, after: str) -> str:
        if not after.startswith(before):
            raise DataError(
                f"chat template {self.name} renders a conversation's turns differently once "
                "more turns follow; only templates whose renders extend each other are supported"
            )
        return after[len(before) :]


def _raise_template_error(message: str) -> None:
    raise DataError(f"chat template: {message}")


def load_template(spec: str) -> ChatTemplate:
    """data.chat_template: a built-in name, a .jinja file, or a tokenizer_config.json (or the
    directory holding one) whose `chat_template` is used."""
    if spec in BUILTIN_TEMPLATES:
        return ChatTemplate(BUILTIN_TEMPLATES[spec], spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer_config.json"
    if not path.is_file():
        raise DataError(
            f"data.chat_template {spec!r} is neither a built-in ({', '.join(BUILTIN_TEMPLATES)}) "
            "nor a .jinja file or tokenizer_config.json"
        )
    text = path.read_text()
    if path.suffix != ".json":
        return ChatTemplate(text, str(path))
    template = json.loads(text).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not isinstance(template, str):
        raise DataError(f"{path} has no chat_template string")
    return ChatTemplate(template, str(path))


@dataclass(frozen=True)
class Encoded:
    """One tokenized example: token ids and a 0/1 loss flag per token (1: predicting this
    token counts)."""

    tokens: np.ndarray  # [n] int32
    loss: np.ndarray  # [n] int32


def encode(
    template: ChatTemplate, tokenizer: tokenizers.Tokenizer, messages: Messages, eos: bool = True
) -> Encoded:
    """A conversation's tokens and loss flags; with eos, the EOS id last, carrying loss."""
    pieces = template.pieces(messages)
    ids = tokenizer.encode([text for text, _ in pieces])
    flags = [
        np.full(len(piece_ids), loss, np.int32)
        for piece_ids, (_, loss) in zip(ids, pieces, strict=True)
    ]
    tokens = [np.asarray(piece_ids, np.int32) for piece_ids in ids]
    if eos:
        tokens.append(np.asarray([tokenizer.eos_id], np.int32))
        flags.append(np.ones(1, np.int32))
    return Encoded(np.concatenate(tokens), np.concatenate(flags))


# ---- JSONL --------------------------------------------------------------------------------------


def read_jsonl(path: str) -> list[tuple[str, dict[str, Any]]]:
    """(where: "FILE:LINE", object) of each line of a JSONL file; DataError naming the file and
    line of the first that is not a JSON object."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"no such JSONL file: {path}")
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: expected a JSON object")
        rows.append((f"{path}:{number}", row))
    if not rows:
        raise DataError(f"{path} holds no examples")
    return rows


def conversation(row: dict[str, Any], where: str) -> Messages:
    """A chat example's messages, checked: roles known, contents strings, an assistant turn."""
    if "messages" in row:
        messages = row["messages"]
    elif "prompt" in row and "completion" in row:
        messages = [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["completion"]},
        ]
    else:
        raise DataError(f"{where}: expected 'messages', or 'prompt' and 'completion'")
    return _checked(messages, where, need_assistant=True)


def preference(row: dict[str, Any], where: str) -> tuple[Messages, Messages]:
    """A preference pair as two conversations: (prompt + chosen, prompt + rejected)."""
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
    if missing:
        raise DataError(
            f"{where}: a preference pair needs prompt, chosen, rejected (no {missing[0]})"
        )
    prompt = row["prompt"]
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    prompt = _checked(prompt, where, need_assistant=False)
    answers = []
    for key in ("chosen", "rejected"):
        if not isinstance(row[key], str):
            raise DataError(f"{where}: {key} must be a string")
        answers.append([*prompt, {"role": "assistant", "content": row[key]}])
    return answers[0], answers[1]


def _checked(messages: Any, where: str, need_assistant: bool) -> Messages:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(f"{where}: every message needs a role among {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: a message's content must be a string")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


# ---- grain sources ------------------------------------------------------------------------------


class ChatExamples:
    """A chat source, tokenized in memory: the documents the pipeline packs, each
    {"tokens": [n], "loss": [n]} (a grain RandomAccessDataSource, picklable for workers)."""

    def __init__(self, examples: Sequence[Encoded]):
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        e = self.examples[i]
        return {packing.FEATURE: e.tokens, packing.LOSS: e.loss}

    @property
    def num_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.examples)


def chat_examples(
    path: str, template: ChatTemplate, tokenizer: tokenizers.Tokenizer
) -> ChatExamples:
    rows = read_jsonl(path)
    return ChatExamples([encode(template, tokenizer, conversation(r, where)) for where, r in rows])


class PreferenceRows:
    """A preference source as ready rows: one pair per row, the chosen answer segment 1, the
    rejected one segment 2, zero padding; pairs longer than a row are dropped (counted in
    `dropped`). Each row is a packed row as grain's packers make them."""

    def __init__(self, pairs: Sequence[tuple[Encoded, Encoded]], row_len: int):
        self.row_len = row_len
        kept = [p for p in pairs if len(p[0].tokens) + len(p[1].tokens) <= row_len]
        self.pairs, self.dropped = kept, len(pairs) - len(kept)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        tokens, loss = packing.FEATURE, packing.LOSS
        segments, positions = f"{tokens}_segment_ids", f"{tokens}_positions"
        row = {k: np.zeros(self.row_len, np.int32) for k in (tokens, segments, positions, loss)}
        start = 0
        for segment, e in enumerate(self.pairs[i], 1):
            span = slice(start, start + len(e.tokens))
            row[tokens][span], row[loss][span] = e.tokens, e.loss
            row[segments][span] = segment
            row[positions][span] = np.arange(len(e.tokens))
            start = span.stop
        return row

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) + len(r.tokens) for c, r in self.pairs)


def preference_rows(
    path: str, template: ChatTemplate, tokenizer: tokenizers.Tokenizer, row_len: int
) -> PreferenceRows:
    pairs = []
    for where, row in read_jsonl(path):
        chosen, rejected = preference(row, where)
        pairs.append((encode(template, tokenizer, chosen), encode(template, tokenizer, rejected)))
    rows = PreferenceRows(pairs, row_len)
    if not rows.pairs:
        raise DataError(f"{path}: no preference pair fits a row of {row_len} tokens")
    return rows

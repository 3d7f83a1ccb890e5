"""Fine-tuning: chat data masks all but the assistant, packing changes no loss, SFT resumes
exactly, and the DPO objective is the formula (checked against a direct computation)."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.config import ConfigError
from maxtrain.config.run import DPOConfig
from maxtrain.data import chat, to_global
from maxtrain.data.grain_pipeline import Pipeline
from maxtrain.posttrain.dpo import DPO, ReferenceCopy
from maxtrain.training.loop import build_trainer
from maxtrain.training.objectives import NEXT_TOKEN
from maxtrain.training.step import summed_grads

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "12 + 30 = 42."},
    {"role": "user", "content": "And 42 - 2?"},
    {"role": "assistant", "content": "42 - 2 = 40."},
]
TINY_SFT = [
    "model_name=tiny",
    "model.vocab_size=1024",  # the default tokenizer's
    "data.kind=grain",
    "data.packing=first_fit",
    "data.eval_fraction=0",
    "train.seq_len=64",
]


@pytest.fixture(scope="module")
def tokenizer():
    return chat.load_tokenizer(None)


@pytest.mark.parametrize("template", ["chatml", "plain", "tokenizer_config"])
def test_loss_flags_cover_exactly_the_assistant_tokens(template, tokenizer, tmp_path):
    if template == "tokenizer_config":  # a template as Hugging Face tokenizers ship it
        config = {
            "chat_template": [{"name": "default", "template": chat.BUILTIN_TEMPLATES["chatml"]}]
        }
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        spec, end = str(tmp_path), "<|im_end|>\n"
    else:
        spec, end = template, {"chatml": "<|im_end|>\n", "plain": "\n\n"}[template]
    encoded = chat.encode(chat.load_template(spec), tokenizer, CONVERSATION)
    # Runs of loss-carrying tokens: each assistant turn with its end marker, then the EOS.
    edges = np.flatnonzero(np.diff(np.r_[0, encoded.loss, 0]))
    runs = [encoded.tokens[a:b] for a, b in zip(edges[::2], edges[1::2], strict=True)]
    assert len(runs) == 2
    assert tokenizer.decode(runs[0]).strip() == f"12 + 30 = 42.{end}".strip()
    assert tokenizer.decode(runs[1][:-1]).strip() == f"42 - 2 = 40.{end}".strip()
    assert runs[1][-1] == tokenizer.eos_id
    # Everything else is the context: the system and user turns and the template's headers.
    context = tokenizer.decode(encoded.tokens[encoded.loss == 0])
    for m in CONVERSATION:
        assert (m["content"] in context) == (m["role"] != "assistant")


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer, tmp_path):
    (tmp_path / "t.jinja").write_text(
        "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(chat.DataError, match="renders a conversation's turns differently"):
        chat.encode(chat.load_template(str(tmp_path / "t.jinja")), tokenizer, CONVERSATION)


def _write_chat(path, n=24):
    rows = []
    for i in range(n):
        a, b = 17 * i + 3, 5 * i + 11
        rows.append({"prompt": f"What is {a} + {b}?", "completion": f"{a} + {b} = {a + b}."})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sft_overrides(tmp_path, *extra):
    path = _write_chat(tmp_path / "chat.jsonl")
    source = f"data.sources=[{{name: chat, path: {path}, format: chat}}]"
    return [*TINY_SFT, source, "train.task=sft", *extra]


def test_packed_conversations_give_the_loss_they_give_alone(make_cfg, tmp_path, tokenizer):
    cfg = make_cfg(*_sft_overrides(tmp_path, "train.global_batch_size=2", "train.seq_len=160"))
    batch = next(iter(Pipeline(cfg, num_epochs=1).train()))
    segments = batch["segment_ids"]
    assert segments.max() >= 2  # several conversations share a row
    # Each masked target is an assistant token: the answers, "<|im_end|>\n" and EOS.
    answers = tokenizer.decode(batch["targets"][batch["loss_mask"] == 1])
    assert " = " in answers and "What is" not in answers and "user" not in answers
    # The same conversations, each alone in a row of its own (padded).
    alone = {k: [] for k in batch}
    for r, s in zip(*np.nonzero(np.diff(segments, prepend=0, axis=1) > 0), strict=True):
        span = segments[r] == segments[r, s]
        for k, v in batch.items():
            row = np.zeros_like(v[r])
            row[: span.sum()] = v[r][span]
            alone[k].append(row)
    rows = max(len(alone["inputs"]), len(segments))  # both padded to one shape: one compile
    alone = {k: np.pad(np.stack(v), ((0, rows - len(v)), (0, 0))) for k, v in alone.items()}
    batch = {k: np.pad(v, ((0, rows - len(v)), (0, 0))) for k, v in batch.items()}
    trainer = build_trainer(cfg, jax.devices()[:1])
    fn = jax.jit(lambda p, b: NEXT_TOKEN(trainer.mdef, p, b, 0.0)[:2])
    nll_packed, count_packed = fn(trainer.state.params, batch)
    nll_alone, count_alone = fn(trainer.state.params, alone)
    assert count_packed == count_alone == batch["loss_mask"].sum()
    np.testing.assert_allclose(nll_packed, nll_alone, rtol=2e-5)


def test_sft_data_resumes_exactly(make_cfg, tmp_path):
    """The SFT stream's position survives a JSON round trip (as checkpoints store it) and the
    restored stream continues with the very batches the uninterrupted one gives."""
    cfg = make_cfg(*_sft_overrides(tmp_path, "train.global_batch_size=2"))
    whole = Pipeline(cfg).train_iterator()
    expected = [next(whole) for _ in range(5)]
    stopped = Pipeline(cfg).train_iterator()
    for _ in range(2):
        next(stopped)
    resumed = Pipeline(cfg).train_iterator()
    resumed.set_state(json.loads(json.dumps(stopped.get_state())))
    for want in expected[2:]:
        got = next(resumed)
        assert all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(
    "line, error",
    [
        (
            '{"messages": [{"role": "user", "content": "hi"}]}',
            "the conversation has no assistant turn",
        ),
        (
            '{"messages": [{"role": "bot", "content": "hi"}]}',
            "every message needs a role among system, user",
        ),
        ('{"prompt": "hi"}', "expected 'messages', or 'prompt' and 'completion'"),
        ("not json", "not JSON"),
    ],
)
def test_a_bad_conversation_is_named_by_file_and_line(make_cfg, tmp_path, line, error):
    path = _write_chat(tmp_path / "bad.jsonl", n=2)
    path.write_text(path.read_text() + "\n" + line + "\n")  # line 4, after a blank one
    source = f"data.sources=[{{name: chat, path: {path}, format: chat}}]"
    with pytest.raises(chat.DataError, match=rf"data.sources\[chat\]: {path}:4: {error}"):
        Pipeline(make_cfg(*TINY_SFT, source, "train.task=sft"))


def test_dpo_needs_preference_sources_and_a_start_checkpoint(make_cfg):
    with pytest.raises(ConfigError, match="train.task=dpo"):
        make_cfg("train.task=dpo")
    with pytest.raises(ConfigError, match="load_parameters_path"):
        make_cfg(
            "data.kind=grain",
            "train.task=dpo",
            "data.sources=[{name: p, path: p.jsonl, format: preference}]",
        )


# ---- DPO ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dpo_case(tmp_path_factory):
    """A tiny model, a batch of preference rows, and a reference a little off the policy."""
    from maxtrain import config as config_lib

    tmp = tmp_path_factory.mktemp("dpo")
    pairs = [{"prompt": f"{i} + {i}?", "chosen": f"{2 * i}.", "rejected": "No."} for i in range(8)]
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    cfg = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml",
        [
            *TINY_SFT,
            f"run.output_dir={tmp}",
            "train.global_batch_size=2",
            "train.seq_len=48",
            "data.chat_template=plain",
            "train.eval_every=0",
            "train.task=dpo",
            "checkpoint.load_parameters_path=unused",
            f"data.sources=[{{name: pairs, path: {tmp / 'pairs.jsonl'}, format: preference}}]",
        ],
    )
    trainer = build_trainer(cfg, jax.devices()[:1])
    local = next(iter(Pipeline(cfg, num_epochs=1).train()))
    params = trainer.state.params
    noise = jax.tree.map(lambda x: 0.02 * jnp.cos(jnp.arange(x.size).reshape(x.shape)), params)
    reference = jax.tree.map(jnp.add, params, noise)
    return trainer, to_global(local, trainer.batch_sharding), params, reference


def _direct_dpo(trainer, params, reference, batch, beta):
    """DPO's mean loss written out from the logits: log-softmax, gather, sums per answer."""
    segments, mask = batch["segment_ids"], batch["loss_mask"]
    chosen = ((segments == 1) & (mask == 1)).astype(jnp.float32)
    rejected = ((segments == 2) & (mask == 1)).astype(jnp.float32)

    def answer_logps(p):
        logits = trainer.mdef.apply(p, batch["inputs"], batch["positions"], batch["segment_ids"])[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        taken = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        return (taken * chosen).sum(-1), (taken * rejected).sum(-1)

    def loss(p):
        pc, pr = answer_logps(p)
        rc, rr = answer_logps(reference)
        margin = beta * ((pc - rc) - (pr - rr))
        return jnp.mean(jnp.log1p(jnp.exp(-margin)))  # -log sigmoid

    return jax.value_and_grad(loss)(params)


def test_dpo_step_loss_and_gradients_are_the_formula(dpo_case):
    trainer, batch, params, reference = dpo_case
    beta = 0.5
    objective = DPO(DPOConfig(beta=beta, loss="sigmoid"))
    both = jax.jit(  # one program: one compilation
        lambda p, r, b: (
            summed_grads(trainer.mdef, p, b, 0.0, objective, frozen=r, split=ReferenceCopy()),
            _direct_dpo(trainer, p, r, b, beta),
        )
    )
    (grads, sums), (expected_loss, expected_grads) = both(params, reference, batch)
    pairs = sums.count
    assert pairs == batch["inputs"].shape[0]
    np.testing.assert_allclose(sums.loss / pairs, expected_loss, rtol=1e-5)
    for (path, g), e in zip(
        jax.tree.leaves_with_path(grads), jax.tree.leaves(expected_grads), strict=True
    ):
        np.testing.assert_allclose(
            g / pairs, e, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path)
        )


def test_dpo_loss_is_log_2_when_the_policy_is_the_reference(dpo_case):
    trainer, batch, params, _ = dpo_case
    sums = DPO(DPOConfig(beta=0.1, loss="sigmoid"))(trainer.mdef, params, batch, 0.0, params)
    pairs = sums.count
    np.testing.assert_allclose(sums.loss / pairs, math.log(2), rtol=1e-6)
    assert sums.sums["dpo/reward_margin"] == 0 and sums.sums["dpo/accuracy"] == pairs / 2  # ties


def test_a_dpo_run_and_the_evaluate_tool_score_the_same_objective(make_cfg, tmp_path):
    """Two DPO steps from a saved start checkpoint, evaluated after each: the loop's held-out
    DPO loss and accuracy at the end are what `python -m maxtrain.evaluate --loss` prints for
    the saved step, which it scores against the start checkpoint (the reference) as training
    did; after the first step, whose rate is 0 (warmup), the policy is still the reference:
    log 2."""
    from maxtrain import config as config_lib
    from maxtrain import evaluate as evaluate_cli
    from maxtrain.checkpointing.export import save_parameters
    from maxtrain.training import loop

    pairs = [{"prompt": f"{i} + {i}?", "chosen": f"{2 * i}.", "rejected": "No."} for i in range(40)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    common = [
        *TINY_SFT,
        "data.chat_template=plain",
        "data.eval_fraction=0.2",
        "train.eval_steps=1",
        f"data.sources=[{{name: pairs, path: {tmp_path / 'pairs.jsonl'}, format: preference}}]",
    ]
    start = make_cfg(*TINY_SFT)
    trainer = build_trainer(start, jax.devices()[:1])
    save_parameters(tmp_path / "start", trainer.state.params, config_yaml=config_lib.to_yaml(start))
    dpo = [*common, "train.task=dpo", f"checkpoint.load_parameters_path={tmp_path / 'start'}"]
    cfg = make_cfg(*dpo, "train.steps=2", "train.eval_every=1", "optim.lr=1e-2", "run.name=dpo")
    assert cfg.optim.warmup_steps == 1  # the first step's rate is 0
    trained = loop.run(cfg)
    lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    at_start = next(r for r in map(json.loads, lines) if r["step"] == 1 and "eval/loss" in r)
    assert math.isclose(at_start["eval/loss"], math.log(2), rel_tol=1e-5)
    assert trained["eval/loss"] < math.log(2)  # two steps on these pairs move the policy
    out = tmp_path / "scores.json"
    assert evaluate_cli.main([str(cfg.run_dir), "--no-tasks", "--loss", "--output", str(out)]) == 0
    scores = json.loads(out.read_text())
    assert math.isclose(scores["loss"], trained["eval/loss"], rel_tol=1e-5)
    assert math.isclose(scores["loss/dpo/accuracy"], trained["eval/dpo/accuracy"], rel_tol=1e-6)

"""The plan's search before anything compiles: the factorisations, the rules that rule a
candidate out (each with its reason), the config's own layout as a candidate, a candidate's
overlay as the config keys a run reads, the memory sieve, and what a refusal passes over."""

import json
import math

from maxtrain import config as config_lib
from maxtrain.common import devices
from maxtrain.config import MESH_AXES
from maxtrain.parallel.mesh import axis_sizes
from maxtrain.planning import candidates as lib
from maxtrain.planning import compiling, plan
from maxtrain.planning.screening import Screened, screen, with_layout

V5E = devices.chip("tpu v5e")
RECIPES = config_lib.REPO_ROOT / "recipes" / "tpu-v5e"


def test_factorisations_are_every_ordered_product_once():
    found = list(lib.factorisations(8, 3))
    assert len(found) == len(set(found)) == math.comb(3 + 2, 2)  # 2^3 over 3 slots
    assert all(math.prod(f) == 8 for f in found)


def _candidate(remat="full", accum=1, **degrees) -> lib.Candidate:
    ici = tuple(degrees.get(a, 1) for a in MESH_AXES)
    return lib.Candidate(ici, (1,) * len(MESH_AXES), remat, accum)


def test_each_rule_names_why(make_cfg):
    cfg = make_cfg("train.global_batch_size=8", "train.seq_len=128")  # tiny: 4 heads, 2 kv
    assert lib.rule_out(cfg, _candidate(fsdp=4), "tpu v5 lite", 4) is None
    assert lib.rule_out(cfg, _candidate(tensor=4), "tpu v5 lite", 4) == (
        "heads not divisible by tensor"
    )
    assert lib.rule_out(cfg, _candidate(fsdp=16), "tpu v5 lite", 16) == (
        "micro-batch not divisible by the batch axes"
    )
    assert lib.rule_out(cfg, _candidate(fsdp=2, context=2), "tpu v5 lite", 4) == (
        "context where the batch could split (dominated)"
    )
    assert lib.rule_out(cfg, _candidate(stage=4, fsdp=1), "tpu v5 lite", 4) == (
        "layers not divisible by the stages"
    )
    moe = make_cfg("model_name=tiny-moe", "train.global_batch_size=64")
    ragged = lib.Candidate(_candidate(expert=4, fsdp=8).ici, (1,) * 6, "full", 1, None, "ragged")
    assert lib.rule_out(moe, ragged, "tpu v5 lite", 32) == (
        "ragged exchange does not compile on this slice"
    )


def test_the_config_layout_is_a_candidate_whose_overlay_gives_it_back():
    """The two-slice 70B recipe (tensor 8, FSDP the rest, two pipeline stages over DCN, a
    circular schedule's micro-batches): as a candidate and back through its overlay, the same
    mesh, micro-batches and pipeline."""
    cfg = config_lib.load(RECIPES / "llama3-70b-two-slices.yml")
    c = lib.config_candidate(cfg, 256)
    assert (c.degree("tensor"), c.degree("fsdp"), c.degree("stage")) == (8, 32, 2)
    again = with_layout(cfg, c)
    assert axis_sizes(again.mesh, 512) == axis_sizes(cfg.mesh, 512)
    assert again.pipeline == cfg.pipeline and again.train == cfg.train
    assert lib.rule_out(cfg, c, "tpu v5 lite", 256) is None


def test_the_memory_sieve_drops_what_cannot_fit_and_needless_micro_batches():
    """Llama 3 8B on 4 v5e chips cannot hold its float32 state whatever the layout; over 256
    chips FSDP fits with remat full and one micro-batch, so more are dropped, and without remat
    it does not fit with any."""
    cfg = config_lib.load(RECIPES / "llama3-8b.yml")
    few = [c for c in lib.enumerate_candidates(cfg, 4, 1) if c.remat == "full"][:6]
    kept, dropped = screen(cfg, few, V5E, 4)
    assert kept == [] and dropped == {"memory estimate over 1.3 x HBM": len(few)}
    layouts = [
        lib.Candidate(_candidate(fsdp=256).ici, (1,) * 6, remat, accum)
        for remat in ("full", "none")
        for accum in (1, 2, 4)
    ]
    kept, dropped = screen(cfg, layouts, V5E, 256)
    assert [(s.candidate.remat, s.candidate.grad_accum) for s in kept] == [("full", 1)]
    assert dropped == {
        "more micro-batches than memory needs (dominated)": 2,  # full with 2 and 4
        "memory estimate over 1.3 x HBM": 3,  # no remat: every layer's activations, 8K tokens
    }


def test_a_plan_without_a_target_is_refused_in_one_line(capsys):
    base = str(config_lib.CONFIGS_DIR / "base.yml")
    assert plan.main([base, "model_name=tiny"]) == 2
    assert plan.main([base, "model_name=tiny", "--device", "a100"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "plan: error: give --topology (a TPU slice, e.g. v5e:4x4) or --device h100 --devices N",
        "plan: error: --device 'a100': expected h100, h200 or b200",
    ]


def test_a_refusal_passes_over_the_same_kind_from_the_bar_it_sets():
    """remat minimal at an estimate of 13.4 GiB refused by the compiler: minimal from 13.4 GiB
    is passed over; at 12 it is not, nor is remat full at any estimate nor a pipelined minimal
    (their estimates err otherwise). Compiled at 20 GiB over a 16 GiB chip, the same estimate
    sets the bar at 13.4 x 16 / 20 = 10.72 GiB."""
    minimal = Screened(_candidate("minimal", fsdp=256), 13.4, 1.0)
    alike = lambda c, gib, peak: plan.refused_alike(Screened(c, gib, 1.0), [(minimal, peak)], 16)  # noqa: E731
    why = alike(_candidate("minimal", fsdp=128, expert=2), 13.4, None)
    assert why == (
        "passed over: fsdp 256 | remat minimal | accum 1 did not fit (estimate 13.40 GiB): "
        "its kind from 13.40 GiB does not"
    )
    assert alike(_candidate("minimal", fsdp=128, expert=2), 12.0, None) is None
    assert alike(_candidate("full", fsdp=256), 14.0, None) is None
    assert alike(_candidate("minimal", fsdp=128, stage=2), 14.0, None) is None
    assert "from 10.72 GiB" in alike(_candidate("minimal", fsdp=128, expert=2), 10.72, 20.0)
    assert alike(_candidate("minimal", fsdp=128, expert=2), 10.7, 20.0) is None


def test_the_pool_takes_groups_in_order_up_to_the_limit_not_counting_those_passed_over(
    tmp_path, monkeypatch
):
    """Five one-job groups whose verdicts are in the cache (nothing compiles): the third is
    passed over once the first's refusal is known, so the limit of three takes the first,
    second and fourth, and the fifth keeps no result."""
    monkeypatch.setenv("MAXTRAIN_CACHE", str(tmp_path))
    jobs = [compiling.Job("c.yml", [f"n={i}"], "v5e:2x2", 1, str(i)) for i in range(5)]
    verdicts = [{"refused": "out of memory"}, *({"fits": True, "step_s": i} for i in range(1, 5))]
    compiling.cache_dir().mkdir(parents=True)
    for job, verdict in zip(jobs, verdicts, strict=True):
        (compiling.cache_dir() / f"{job.key()}.json").write_text(json.dumps(verdict))
    said = []

    def pass_over(group):
        return "after a refusal" if group[0] is jobs[2] and jobs[0].result else None

    compiling.run_jobs([[j] for j in jobs], 2, 60.0, said.append, 3, pass_over)
    assert [j.result for j in jobs] == [
        *verdicts[:2],
        {"skipped": "after a refusal"},
        verdicts[3],
        None,
    ]
    assert said[-1].startswith("plan: 3 candidates taken, 1 passed over; 3 compiles from the cache")

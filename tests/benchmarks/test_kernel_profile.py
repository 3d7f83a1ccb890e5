"""tools/profile_kernels.py: kernel time per step, grouped by what the kernels do."""

import json

from maxtrain.benchmarks import kernel_profile as profile_kernels


def _table(rows):
    cols = [{"id": "kernel_name"}, {"id": "occurrences"}, {"id": "total_duration_us"}]
    return {"cols": cols, "rows": [{"c": [{"v": n}, {"v": 1}, {"v": us}]} for n, us in rows]}


def test_kernels_are_grouped_and_divided_by_the_steps(tmp_path, capsys):
    rows = [
        ("ragged_contracting_dim_dot_sm90_mosaic_gpu_kernel", 4000.0),  # weight gradients
        ("ragged_dot_sm90_mosaic_gpu_kernel", 3000.0),
        ("input_scatter_fusion_61", 1000.0),
        ("loop_gather_fusion", 500.0),
        ("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", 900.0),
        ("loop_add_fusion_2", 600.0),
    ]
    groups = profile_kernels.per_step(profile_kernels.kernel_times(_table(rows)), steps=2)
    assert groups == {
        "grouped matmul, expert weight gradients": 2.0,
        "grouped matmul, forward and input gradients": 1.5,
        "gathers and scatters": 0.75,
        "dense matmuls": 0.45,
        "element-wise and reductions": 0.3,
    }
    saved = tmp_path / "kernel_stats.json"
    saved.write_text(json.dumps([_table(rows), {}]))  # xprof writes a list of tables
    assert profile_kernels.main(["--kernel-stats", str(saved), "--steps", "2"]) == 0
    assert "5.0 ms/step  all kernels" in capsys.readouterr().out


def test_a_missing_trace_is_one_line(tmp_path, capsys):
    assert profile_kernels.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds no *.xplane.pb trace" in err

"""One compile of a plan, in its own process: `python -m maxtrain.planning.worker REQUEST`,
REQUEST a JSON object {config, overrides, topology, slices, out}. It compiles the train step for
the topology as `tools/benchmark.py --dry-run --compile` does and writes to `out` what the plan
ranks by: the compiler's peak memory per chip (or its refusal) and the predicted step."""

from __future__ import annotations

import json
import sys

from maxtrain import config as config_lib
from maxtrain.benchmarks.step import dry_run
from maxtrain.common import files
from maxtrain.parallel.topology import topology_devices


def verdict(request: dict) -> dict:
    """{fits, peak_gib, step_s, bound, seconds_by_category, compile_s} or {fits: False,
    refused: the compiler's line}."""
    cfg = config_lib.load(request["config"], request["overrides"])
    devices = topology_devices(request["topology"], cfg.mesh.num_slices)
    compiled = dry_run(cfg, len(devices), True, devices[0].device_kind, devices)["compiled"]
    if "compiler_refused" in compiled:
        return {"fits": False, "refused": compiled["compiler_refused"]}
    predicted = compiled["predicted"]
    return {
        "fits": compiled["fit"]["fits"],
        "peak_gib": compiled["gib_per_device"]["peak"],
        "step_s": predicted.get("step_s"),
        "bound": predicted.get("bound"),
        "seconds_by_category": predicted.get("seconds_by_category", {}),
        "compile_s": compiled["compile_s"],
    }


def main(argv: list[str]) -> int:
    request = json.loads(argv[0])
    files.write_atomic(request["out"], json.dumps(verdict(request)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

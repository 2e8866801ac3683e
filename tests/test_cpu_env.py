"""deployments/cpu.env: Serve reads what it sets, bash and python read it alike (the CPU pods carry it:
tests/test_cluster_manifests.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deployments.runtime.cpu_env import CPU_ENV_FILE, cpu_env

REPO = Path(__file__).resolve().parent.parent
# each variable -> the Ray Serve constant it sets (ray/serve/_private/constants.py of the pinned Ray)
SERVE_CONSTANTS = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "CONTROL_LOOP_INTERVAL_S",
                   "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"}
# each variable -> the shared library that reads it, which torch must have loaded for the setting to do anything
LIBRARY_VARIABLES = {"GOMP_SPINCOUNT": "libgomp"}


def test_ray_serve_takes_every_value_the_file_sets():
    values = {name: value for name, value in cpu_env().items() if name not in LIBRARY_VARIABLES}
    assert set(values) == set(SERVE_CONSTANTS), "a new variable needs its constant here, so it is checked"
    probe = ("import json, ray.serve._private.constants as c; "
             f"print(json.dumps({{name: getattr(c, name) for name in {sorted(SERVE_CONSTANTS.values())!r}}}))")
    clean = {name: value for name, value in os.environ.items() if name not in SERVE_CONSTANTS}
    defaults = json.loads(subprocess.run([sys.executable, "-c", probe], env=clean, check=True,
                                         capture_output=True, text=True).stdout)
    taken = json.loads(subprocess.run([sys.executable, "-c", probe], env={**clean, **values}, check=True,
                                      capture_output=True, text=True).stdout)
    for variable, constant in SERVE_CONSTANTS.items():
        assert taken[constant] == type(taken[constant])(values[variable])
        assert taken[constant] != defaults[constant], f"{variable} sets what Serve does anyway"


def test_bash_reads_the_file_as_python_does_and_main_sh_exports_it():
    exported = subprocess.run(["bash", "-c", f"set -a; . {CPU_ENV_FILE}; set +a; env -0"], env={}, check=True,
                              capture_output=True, text=True).stdout
    from_bash = dict(item.split("=", 1) for item in exported.split("\0") if "=" in item)
    assert {name: from_bash.get(name) for name in cpu_env()} == cpu_env()
    assert "set -a; . deployments/cpu.env; set +a" in (REPO / "scripts" / "main.sh").read_text()


def test_a_variable_without_a_value_is_an_error(tmp_path):
    env_file = tmp_path / "cpu.env"
    env_file.write_text("# comment\nRAY_SERVE_CONTROL_LOOP_INTERVAL_S=1.0\nRAY_SERVE_METRICS_EXPORT_INTERVAL_MS\n")
    with pytest.raises(ValueError, match="RAY_SERVE_METRICS_EXPORT_INTERVAL_MS without a value"):
        cpu_env(env_file)


@pytest.mark.parametrize("variable, library", sorted(LIBRARY_VARIABLES.items()))
def test_the_openmp_setting_is_for_the_runtime_torch_runs_its_passes_on(variable, library):
    """GOMP_SPINCOUNT is read by GNU OpenMP only: torch's parallel passes must run on libgomp for it to count."""
    assert variable in cpu_env()
    probe = ("import torch; torch.set_num_threads(2); torch.ones(1 << 20).sum(); "
             "print(open('/proc/self/maps').read())")
    maps = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert library in maps, f"torch runs on another OpenMP runtime: {variable} does nothing"

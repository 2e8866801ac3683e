"""deployments/cpu.env, the environment of Ray's processes for serving on a machine of few CPU cores.

One file read by every place that starts such a server (scripts/main.sh sources it; the benchmarks read it
here), so the README's server and the measured one run alike. python-dotenv parses it, as bash reads it.
"""

from __future__ import annotations

from pathlib import Path

from dotenv import dotenv_values

CPU_ENV_FILE = Path(__file__).resolve().parents[1] / "cpu.env"


def cpu_env(path: Path = CPU_ENV_FILE) -> dict[str, str]:
    """NAME -> value of every variable the file sets; a line without a value is an error, not an unset name."""
    values = dotenv_values(path)
    unset = sorted(name for name, value in values.items() if value is None)
    if unset:
        raise ValueError(f"{path}: {', '.join(unset)} without a value (write NAME=VALUE)")
    return dict(values)

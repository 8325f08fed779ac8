"""`sweep --ray` and `demo --ray` on a real Ray cluster give the same JSON as the process pool.

Run by `make test-ray` in .venv-ray (Ray from PyPI; tests/ray_harness/setup_venv.sh), not by `make test`
(the file name keeps it out of the default collection). The module starts a local Ray cluster on
127.0.0.1 (two CPUs, as this project's CI machine has) and stops it at the end; every command runs as
its own process, a separate Ray driver that finds the cluster through `--ray-address` or `RAY_ADDRESS`,
as on a laptop with a running local Ray or on a real cluster, or starts its own local one (no address).
Only wall-clock fields may differ. Ray is kept on the loopback address: with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 it runs in its single-machine mode (otherwise it binds the host's
outward-facing address, even when told 127.0.0.1).
"""
import json
import os
import subprocess
import sys

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"     # before ray is imported; inherited by the commands
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"               # no usage report leaves the machine
import ray  # noqa: E402

SIM = ["--workload", "fusionbench", "--pair", "Qwen2.5-7B/Llama-3.1-8B", "--policies", "no-shadow,harvest-slo",
       "--duration", "8", "--warmup", "1", "--instances", "1", "--session-rate", "0.5",
       "--capacity", "Qwen2.5-7B=2,Llama-3.1-8B=2"]
DEMO = ["demo", "--workloads", "fusionbench", "--seeds", "2", "--windows", "peak,trough", "--duration", "10",
        "--warmup", "3", "--capacity", "Qwen2.5-7B=12.8,Llama-3.1-70B=3.8", "--session-rate", "0.6", "--jobs", "2"]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster owned by this process, on the loopback address; its GCS address."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20, logging_level="WARNING")
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()                  # stops the processes this ray.init started


def shadowprefill(args, env_extra=None, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-m", "shadowprefill", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def without_wall_time(obj):
    if isinstance(obj, dict):
        return {k: without_wall_time(v) for k, v in obj.items() if k != "wall_s"}
    if isinstance(obj, list):
        return [without_wall_time(v) for v in obj]
    return obj


def test_sweep_on_ray_equals_the_process_pool(cluster, tmp_path):
    sweep = ["sweep", "--param", "beta", "--values", "0.25,0.5,1.0", *SIM]
    via_ray = shadowprefill([*sweep, "--ray-address", cluster, "--out", str(tmp_path / "ray.json")])
    assert "sweep beta (ray)" in via_ray.stderr                      # the progress bar
    shadowprefill([*sweep, "--jobs", "2", "--out", str(tmp_path / "pool.json")])
    shadowprefill([*sweep, "--ray", "--out", str(tmp_path / "own.json")])    # no address: starts its own Ray
    a = json.loads((tmp_path / "ray.json").read_text())
    b = json.loads((tmp_path / "pool.json").read_text())
    c = json.loads((tmp_path / "own.json").read_text())
    assert [p["value"] for p in a["points"]] == [0.25, 0.5, 1.0]
    assert all(p["policies"]["harvest-slo"]["num_calls"] > 0 for p in a["points"])
    assert without_wall_time(a) == without_wall_time(b) == without_wall_time(c)
    assert a != b or "wall_s" not in json.dumps(a)                   # the wall times were really measured


def test_demo_on_ray_equals_the_process_pool(cluster, tmp_path):
    via_ray = shadowprefill([*DEMO, "--ray", "--out", str(tmp_path / "ray")], env_extra={"RAY_ADDRESS": cluster})
    assert "Ray tasks" in via_ray.stderr and "runs (ray)" in via_ray.stderr      # the header and the bar
    shadowprefill([*DEMO, "--out", str(tmp_path / "pool")])
    a = json.loads((tmp_path / "ray" / "study.json").read_text())
    b = json.loads((tmp_path / "pool" / "study.json").read_text())
    assert [c["window"] for c, _ in a["runs"]] == ["peak", "trough"]
    assert a["aggregate"]["fusionbench"]["no-shadow"]["num_switch_calls"][0] > 0
    assert without_wall_time(a) == without_wall_time(b)

"""The shipped multi-node recipes (scripts/multinode.sh, scripts/slurm.sbatch), which cannot run
here: their DRY_RUN=1 mode prints the environment they set and the exact command line, which must
follow docs/reliability.md (restarts across nodes need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""

import os
import shlex

import pytest

from launchers import run_cmd

OVERRIDES = ["model=alexnet", "sync=ring", "hydra.run.dir=/shared/runs/a b"]  # a space: quoting


def dry_run(script: str, extra_env: dict, args=OVERRIDES) -> tuple[dict, list[str]]:
    """Run `bash scripts/<script>` with DRY_RUN=1: (the exported variables, the command's argv)."""
    proc = run_cmd(["bash", os.path.join("scripts", script), *args], timeout=60,
                   extra_env={"DRY_RUN": "1", **extra_env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    exports = dict(line.removeprefix("export ").split("=", 1) for line in lines[:-1])
    assert all(line.startswith("export ") for line in lines[:-1]), proc.stdout
    return exports, shlex.split(lines[-1])


def assert_multinode_restartable(argv: list[str], exports: dict, nnodes: int, endpoint: str):
    torchrun = argv.index("torchrun")
    module = argv.index("-m")
    launcher = argv[torchrun + 1:module]
    assert f"--nnodes={nnodes}" in launcher
    assert "--rdzv-backend=c10d" in launcher and f"--rdzv-endpoint={endpoint}" in launcher
    assert "--max-restarts=1" in launcher
    assert argv[module + 1] == "ddp_lab.train"
    assert argv[-len(OVERRIDES):] == OVERRIDES  # passed through as given, in order
    assert exports["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_multinode_dry_run_prints_a_restartable_command():
    exports, argv = dry_run("multinode.sh", {"NNODES": "2", "NPROC": "4", "NODE0": "10.0.0.1",
                                             "PORT": "29555", "RDZV_ID": "job7"})
    assert argv[0] == "torchrun" and "--nproc_per_node=4" in argv and "--rdzv-id=job7" in argv
    assert_multinode_restartable(argv, exports, 2, "10.0.0.1:29555")


def test_multinode_keeps_its_interface():
    """MAX_RESTARTS still sets the restarts; without NNODES or NODE0 it refuses to start."""
    _, argv = dry_run("multinode.sh", {"NNODES": "3", "NPROC": "1", "NODE0": "h",
                                       "MAX_RESTARTS": "4"}, args=[])
    assert "--max-restarts=4" in argv and argv[-2:] == ["-m", "ddp_lab.train"]
    proc = run_cmd(["bash", "scripts/multinode.sh"], timeout=60,
                   extra_env={"DRY_RUN": "1", "NODE0": "h", "NNODES": ""})
    assert proc.returncode != 0 and "set NNODES" in proc.stderr


@pytest.mark.parametrize("gpus, nproc", [("8", "8"), ("h200:4", "4")])
def test_slurm_dry_run_prints_a_restartable_command(tmp_path, gpus, nproc):
    """With a stand-in scontrol and the variables SLURM sets in a job."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 1\n'
                        'echo "$3" | tr , "\\n"\n')
    scontrol.chmod(0o755)
    exports, argv = dry_run("slurm.sbatch", {
        "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-a,gpu-b",
        "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "SLURM_GPUS_PER_NODE": gpus})
    assert argv[:2] == ["srun", "torchrun"] and f"--nproc_per_node={nproc}" in argv
    assert "--rdzv-id=4242" in argv and "hydra.run.dir=outputs/slurm/4242" in argv
    assert_multinode_restartable(argv, exports, 2, "gpu-a:29400")
    assert exports["NCCL_NVLS_ENABLE"] == "0"


"""Scaling sweeps over world sizes through torchrun, the efficiency they measure, an alpha-beta
model of what is lost, and a simulation past the hardware.

    python -m ddp_lab.scale                                    # defaults by device (CPU: 1, 2 ranks)
    python -m ddp_lab.scale nproc=[1,2,4,8] syncs=[ddp,ring] model=alexnet precision=bf16
    python -m ddp_lab.scale mode=strong global_batch=1024
    python -m ddp_lab.scale 'sweep=["sync.overlap=true","sync.overlap=false"]' syncs=[ring]
    python -m ddp_lab.scale emit=slurm nodes=[2,4,8]           # multi-node command lines
    python -m ddp_lab.scale simulate=only                      # the simulation alone

Modules: sweep (plan, launch, rows), outputs (csv, TensorBoard, plot, report, manifest),
simulate (tables past the hardware), calibrate (all-reduce timings for the fit), app (Hydra).
The model itself lives in ddp_lab.cost.network.
"""


def main(argv=None) -> None:
    from ddp_lab.scale.app import main as app_main
    app_main(argv)

"""Scaling sweeps over world sizes through torchrun, the efficiency they measure, an alpha-beta
model of what is lost, and a simulation past the hardware.

    python -m ddp_lab.scale                                    # defaults by device (CPU: 1, 2 ranks)
    python -m ddp_lab.scale nproc=[1,2,4,8] syncs=[ddp,ring] model=alexnet precision=bf16
    python -m ddp_lab.scale mode=strong global_batch=1024
    python -m ddp_lab.scale 'sweep=["sync.overlap=true","sync.overlap=false"]' syncs=[ring]
    python -m ddp_lab.scale emit=slurm nodes=[2,4,8]           # multi-node command lines
    python -m ddp_lab.scale simulate=only                      # the simulation alone

Modules, in the order a sweep uses them: config (conf/scale.yaml's schema), sweep (the points),
launch (each a torchrun job), calibrate (all-reduce timings for the fit), interfere (the
interference probe), results (rows from summaries, passes), outputs (csv, TensorBoard, plot,
manifest), report (report.md, console tables), sim_report + sim_plot (the simulation's tables and
plot), app (the Hydra app tying them together). The model itself, inputs to simulation, is
ddp_lab/perf/: this package measures and writes, it holds none of the model.
"""


def main(argv=None) -> None:
    from ddp_lab.scale.app import main as app_main
    app_main(argv)

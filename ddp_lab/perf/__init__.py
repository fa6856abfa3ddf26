"""The performance model: what a data-parallel training step should cost, from what was measured or
given. Three layers, read top to bottom; the sweep (ddp_lab/scale/) and the simulation's report
only call it, and it imports nothing of theirs (nor bench/, train.py).

Inputs, each with where it came from
    params.py       links (alpha, beta) and networks: given presets, each link with its `source`,
                    or measured (a backend's fits); `Interference` (backward and communication
                    slowing each other)
    collectives.py  the formulas: rounds and bytes of each algorithm (`cost`), priced
                    t = steps * alpha + critical_bytes * beta; the two-level ring; every
                    algorithm on a node structure of two links (`allreduce_on_links`)
    fit.py          measured alpha and beta: `fit_alpha_beta` over an all-reduce table, per
                    (algorithm, backend), with message-size regimes and per-world-size fits
    probe.py        the interference probe's result (`Probe`): contention, skew, each bucket's
                    measured time, the slowdowns, when each gradient is ready
    compute.py      the workload's FLOPs: counted, analytic, per layer (`profile_model`); peaks, MFU
    memory.py       the workload's memory: per precision scheme, per ZeRO stage, a step's peak,
                    what a run should hold (`predict_held`)
Composition
    step.py         one step: buckets, the overlap `schedule` with interference, `predict_step`,
                    ZeRO's collectives (`ZERO_OPS`), `bytes_per_step`
    predict.py      a sweep point, phase by phase, from its N=1 point, its probe and the fit
Outputs
    simulate.py     8 ... 1,024 GPUs: efficiency and throughput per network, model, algorithm, N,
                    bucket and dtype, the interference band, all-reduce tables, ZeRO rows

Where "the ring at N=8" comes from:
- in a sweep (predict.predict_rows -> predict_phases): the N=1 ring point's booked phases, each
  scaled by the probe's contention (`Probe.k`), plus the exposed communication of
  `step.schedule`: the ring's buckets (`step.buckets_of`, ready as `Probe.grads` measured),
  each priced at the probe's own all-reduce time of that bucket at N=8
  (`predict.bucket_time_s`, else the fit's `Fit.time_s`) plus packing at its
  `local_s_per_byte`, slowed by `Probe.interference("ring")`; plus stragglers (`Probe.skew`)
  and the guard's all-reduce priced by the `native` fit. docs/scaling.md works it through.
- in the simulation (simulate.simulate -> step.predict_step): AlexNet's buckets by FLOPs
  (`compute.profile_model`), each all-reduce `collectives.cost("ring", S, 8)` priced on
  `params.NVLINK` (given: ~370 GB/s NCCL ring busbw, alpha 3 us assumed), slowed by the assumed
  `sim.interference`.
"""

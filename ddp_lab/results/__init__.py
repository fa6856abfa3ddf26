"""Every published figure rebuilt from its raw files.

Each finding folder under docs/results holds a page (README.md), the raw files its measurements
wrote, and a manifest (figures.json, `ddp_lab.results.manifest`) listing every figure the page,
the index or README.md quotes: the printed value, the raw files, the function that derives it
(`ddp_lab.results.derive`) and where it is quoted. `python -m ddp_lab.results check`
(`ddp_lab.results.check`) recomputes them all, so a typo, a stale number or a figure from the
wrong run fails a test instead of reaching a reader. `python -m ddp_lab.results unquoted`
(`ddp_lab.results.unquoted`) lists the numbers a page prints that no figure quotes: what the
check cannot see.
"""

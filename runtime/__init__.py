"""ExpertSweep's runtime: one exact definition of every miss policy, and the backends that run it.

    core/      policy (the policy table), spec (the run-field table, RunSpec), kernel (numba), errors
    backends/  the backend registry (get_backend) and simulate, emulate, engine with their model code
    formats/   trace (router traces on disk), costmodel (host cost model, presets in data/hosts)
    tools/     record, calibrate, generate, findings, tinymodel, corpus, tinyhf: applications of the above
    cli.py     the `expertsweep` console command; simulate.py, emulate.py, record.py and findings.py
               are its `python -m runtime.X` forms
    data/      host presets and model shapes, shipped as package data

docs/architecture.md draws how they fit together.
"""

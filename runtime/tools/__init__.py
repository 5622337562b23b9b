"""Tools: applications of the core and the backends (record a router trace, calibrate a host, generate
with the engine, the paper's findings, and the tiny reference models with their corpus, tiny random checkpoints of every adapter family). Nothing in
the core or the backends imports them.
"""

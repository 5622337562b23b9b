"""The core: the policy table (policy), the run-field table (spec), the numba policy kernel (kernel)
and the one-line input errors (errors). Everything else in runtime/ is built on these four.
"""

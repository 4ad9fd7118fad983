"""cucopy benchmarks: packed vs chained vs batch-API copies, on a GPU or the simulated device.

``python -m bench`` runs the standard suite (see ``bench/README.md``); each scenario is also
a script of its own (``python bench/step_cost.py --help``).
"""

SCENARIOS = ("step_cost", "decode_loop", "size_sweep", "skip_unchanged")

"""`forerun bench`: acceptance and end-to-end speed per task kind, beside the peers, as tables and plots.

Use `run_bench(BenchConfig(model=..., out=Path(...), methods=[...]))`, or the command line.
"""
from forerun.bench.runner import BenchConfig, BenchResult, run_bench, valid_methods

__all__ = ["BenchConfig", "BenchResult", "run_bench", "valid_methods"]

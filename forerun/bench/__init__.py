"""`forerun bench`: acceptance and end-to-end speed per task kind, beside the peers, as tables and plots.

Use `run_bench(BenchConfig(model=..., out=Path(...), methods=[...]))` from `forerun.bench.runner`, or
the command line.
"""

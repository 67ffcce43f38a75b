"""The engine: one request's step loop (`engine.py`), many requests stepped together (`batch.py`),
their outputs (`sequence.py`) and speculation counters (`metrics.py`)."""

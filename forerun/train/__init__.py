"""Training draft heads on the target's own output: self-distilled data (`data.py`) and the
training loop with checkpoints and curves (`trainer.py`); `forerun train` ties them together."""

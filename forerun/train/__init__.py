"""Training draft heads on the target's own output: self-distilled data (`data.py`, to prompts
of a file or made from code by `code_prompts.py`), corpus text (`corpus.py`) labelled with the
target's own distribution (`soft_labels.py`) and learnt by KL (`soft_losses.py`), and the training
loop with checkpoints, curves and the held-out measure per depth (`trainer.py`, `held_out.py`);
`forerun train` ties them together."""

"""The cost policy: whether and how far to speculate, from measured costs and tracked acceptance.

pass_costs.py (c(r)), draft_length.py (each step's K), catch_up.py (when a one-off catch-up pays),
batch_rates.py (whether a batch drafts at all), draft_model_costs.py (a draft model's own figures).
See docs/architecture.md, Cost policy.
"""

"""Verification: the draft tree every drafter proposes, one target forward over it, the target's
processed distributions, and the exact acceptance rule that keeps the target's output."""

"""Evaluations of a trained policy that are not part of a training step's losses: the exact probability of
bad outputs for short responses (`bad_outputs`)."""

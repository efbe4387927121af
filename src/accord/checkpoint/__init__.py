"""Checkpoints: atomic store, resume rules, schedule, manifest, node folders, LR schedule on resume.

Imports engine state, data order and output helpers; never the loop."""

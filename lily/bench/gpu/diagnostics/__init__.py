"""Diagnostics: where the time goes (profiles, timelines, host time, launch floors, GEMV
traces) and hunts for non-finite values and races."""

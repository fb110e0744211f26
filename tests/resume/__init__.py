"""Exact resume with real processes: kill, signal and deadline a real training script."""

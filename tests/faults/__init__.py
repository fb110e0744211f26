"""Fault injection: kill -9 at every moment of a save, and disks that fill up mid-write."""

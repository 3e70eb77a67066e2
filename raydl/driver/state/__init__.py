"""Resume state: what the driver records per batch (checkpoint.py), torchdata's layout and the check that a
state fits a loader (layout.py), torch's samplers iterated with a state (samplers.py), the seeds and global-RNG
draws an iterator makes (draws.py).
"""

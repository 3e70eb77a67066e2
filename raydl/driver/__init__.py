"""Code that runs in the training process: the epoch's conductor (iter.py), num_workers=0, resume state,
which worker makes which batch, recovery, pinning, stats, and raydl.patch().
"""

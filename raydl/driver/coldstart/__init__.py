"""A new process's first batches, made while Ray starts (NOTE [ raydl cold start ] in iter.py): the iterator
that hands the epoch over to the workers (iter.py), the start-up processes forked from the trainer
(makers.py) and, opt-in, a worker run in the trainer itself (shadow.py).
"""

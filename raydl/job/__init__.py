"""The training job as a whole, across ranks: the global epoch behind torch's DistributedSampler and resume
at another world size (NOTE [ raydl global epoch ]).
"""

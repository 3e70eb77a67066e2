"""Code that runs inside each Ray worker actor: the actor, fetch and collate, its state, seeding, and the
wire format of batches. Imports nothing of the driver: a worker process loads only this package.
"""

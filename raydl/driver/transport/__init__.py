"""How the driver's calls reach the workers and their batches come back: Ray actor calls or a worker's lane
(calls.py chooses per call), the lane's socket and handshake, and the buffers a lane reads replies into.
"""

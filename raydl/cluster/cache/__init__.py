"""The node cache of a streamed dataset (NOTE [ raydl node cache ] in node_actor.py), by the side that runs
each file: node_actor.py in the cache actor (one per node and folder), with peer_units.py (its half that serves and
gets units between nodes' caches), unit_file.py (a unit's file: written
whole, checksummed) and peer_calls.py (its calls to other nodes' caches); driver_feed.py in the training process,
worker_read.py in a worker (unit_file.py checks what it reads), handles.py wherever a cache is found, started or ended.
"""

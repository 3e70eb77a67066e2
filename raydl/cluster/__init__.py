"""Code that talks to the Ray cluster: starting Ray, the worker actors' pool, resizing and autoscaling,
warm idle workers, placement over nodes.
"""

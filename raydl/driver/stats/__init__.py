"""`loader.stats()`: the recorder an iterator reports to (recorder.py), the snapshot it returns (snapshot.py),
the stall hint and Ray metrics (report.py), the Chrome trace and PNG (timeline.py).
"""

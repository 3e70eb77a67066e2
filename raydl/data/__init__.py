"""What is shipped to the workers and the data sources: the payload put once in the object store, shared
Arrow memory, checks of what cannot be pickled, and raydl.ArrowDataset.
"""

"""modeld cell worker: the session contract over HTTP."""
__version__ = "0.1.0"

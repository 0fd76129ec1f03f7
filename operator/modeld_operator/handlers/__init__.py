"""kopf handlers, one module per kind: thin glue around placement.py's pure decisions."""

from . import cell, indexes, session  # noqa: F401  (importing registers the handlers)

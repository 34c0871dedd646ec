"""The ``attnlab`` command line."""

"""The dmlsearch command line."""

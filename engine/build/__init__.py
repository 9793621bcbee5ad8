"""Building and keeping an index: indexing a folder, rebuilds, the Ray runner, prefetch and the watcher."""

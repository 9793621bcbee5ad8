"""The gallery folder: listing files under the symlink rule, labels, and the demo gallery."""

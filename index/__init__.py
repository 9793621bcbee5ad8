"""Vector indexes (FAISS, Milvus), item metadata, manifests, the staged write. Knows nothing about images."""

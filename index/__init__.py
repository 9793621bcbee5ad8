"""Vector indexes (FAISS, Milvus), item metadata and atomic persistence. Knows nothing about images."""

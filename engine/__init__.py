"""Image decoding, preprocessing, ONNX embedding and the search service."""

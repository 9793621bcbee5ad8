"""The model and its bundle: the model card, preprocessing, the ONNX embedder, re-ranker and explainer."""

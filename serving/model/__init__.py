"""The model: the bundle in onnxruntime (predictor), dynamic batching (batcher) and the classification core every
protocol shares (core). No gRPC and no HTTP here."""

"""The models: a bundle in onnxruntime (predictor), dynamic batching (batcher), the classification core every
protocol shares (core, one per model version), the repository on disk (repository) and the models held, loaded,
swapped and unloaded (models). No gRPC and no HTTP here."""

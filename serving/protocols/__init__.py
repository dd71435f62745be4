"""The protocols the server speaks, each a thin layer over the model's core: sentiment.v1, KServe v2, health,
reflection."""

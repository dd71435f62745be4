"""The protocols the server speaks, each a thin layer over the models and the one admission: grpc/ (sentiment.v1,
KServe v2 with its repository extension, health, reflection, and the interceptor every gRPC call passes) and http/
(JSON, KServe v2 REST). What both halves of an API share is here: kserve_v2.py (the KServe v2 rules),
repository_api.py (who may load and unload) and sentiment_v1.py (sentiment.v1's metadata)."""

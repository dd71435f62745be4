"""The protocols the server speaks, each a thin layer over the model's core and the one admission: grpc/ (sentiment.v1,
KServe v2, health, reflection, and the interceptor every gRPC call passes) and http/ (JSON, KServe v2 REST). What both
halves of an API share is here: kserve_v2.py (the KServe v2 rules) and sentiment_v1.py (sentiment.v1's metadata)."""

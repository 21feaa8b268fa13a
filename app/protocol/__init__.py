"""HTTP request/response shapes (Triton generate, KServe v2, OpenAI) and the DAG's own messages."""

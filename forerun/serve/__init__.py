"""`forerun serve`: the OpenAI-compatible HTTP app, its request checks and response shapes, the
scheduler that feeds the batch engine, and the server's Prometheus metrics."""

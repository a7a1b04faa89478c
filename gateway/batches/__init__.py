"""The OpenAI Batch API: files, batch jobs and the worker that runs them through the request path."""

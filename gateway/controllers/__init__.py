"""Thin Litestar controllers: HTTP in, `gateway.pipeline` / `gateway.keys` calls, HTTP out."""

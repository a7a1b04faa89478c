"""The contract between the gateway and its tiers: the OpenAI wire schema (`protocol`), the request
rules (`rules`), the one error type (`errors`), prompt counting with a tier's tokenizer (`prompts`),
the `EngineClient` interface and the HTTP tier client (`client`, over the `http1` pool).

It imports nothing heavy (no torch): the gateway's request path loads it, and a tier may be anyone's
OpenAI-compatible server.
"""

"""``icqs-fast serve``: an OpenAI-compatible HTTP server over the scoring engine (layer 6).

``logprobs``: prompt log-probs with top-N alternatives, shared prefixes computed once;
``queue``: the bounded work queue that batches requests arriving together; ``app``: the FastAPI
application (routes, bearer-token check, body-size limit, OpenAI-style errors).
"""

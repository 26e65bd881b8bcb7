"""``icqs-fast serve``: an OpenAI-compatible HTTP server over the scoring engine (layer 6).

``app``: the :class:`~icqs_fast.serve.app.Server` and its FastAPI routes; ``completions`` and
``scoring``: the two work routes; ``admission``: every limit and the request's price, before
queueing; ``queue`` and ``dispatch``: the bounded, fair work queue and waiting on it;
``generation``: greedy generation a token per step; ``logprobs``: prompt log-probs with shared
prefixes computed once; ``errors``, ``guard``, ``metrics``, ``schemas``, ``config``; ``runner``:
uvicorn, with the graceful shutdown.
"""

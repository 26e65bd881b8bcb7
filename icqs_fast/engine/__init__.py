"""The ICQS engine: :class:`~icqs_fast.engine.scorer.ICQSScorer`, the prefix bank and batcher,
cascade attention, prompts and demonstration sets, continuations, model checks, and the
independent references (naive ICQS, plain forward).
"""

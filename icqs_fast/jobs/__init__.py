"""Scoring jobs over files: read -> batch -> score -> write, with resume and progress
(``score``, ``features``), run in this process or on Ray Data (``ray_actors``,
``ray_executor``; Ray is imported only there).
"""

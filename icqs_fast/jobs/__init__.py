"""Scoring jobs over files: read -> batch -> score -> write, with resume and progress.

``config`` (``ScoreJobConfig``, ``FeatureJobConfig``, ``RayOptions``, ``SelfCheckOptions``: what
a job needs, its options declared once; its ``resume_key()`` is the resume check), ``runner``
(ONE runner, ``run_job``; the executor chosen by name, ``"local"`` or ``"ray"``), ``score`` /
``features`` (the per-command strategies and library functions), ``ray_actors`` /
``ray_executor`` (Ray Data; Ray is imported only there).
"""

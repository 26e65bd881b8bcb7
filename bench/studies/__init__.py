"""Studies behind the defaults: dtypes side by side (:mod:`.precision`), where the engine's time
goes (:mod:`.engine_profile`), ``--help`` startup time (:mod:`.startup`), and the self-check's
bias (:mod:`.selfcheck_study`, :mod:`.selfcheck_outside`)."""

"""Running part of a recorded run again: the program a run records (``program``), the request a replay
runs under (``request``), where a framework's run is entered again (``resume_points``), what a replay runs
and its scratch run (``plan``, ``scratch``), the verifier's word (``consent``), and ``verify`` and ``bisect``."""

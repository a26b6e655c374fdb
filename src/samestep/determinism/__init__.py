"""What makes one run's numbers the same as another's: deterministic mode (``mode``), the numerics knobs it
pins (``numerics``), the environment's fingerprint (``env``), counter-keyed random numbers (``rng``) and
the stop that every rank takes at one step boundary (``preempt``)."""

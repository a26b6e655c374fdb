"""A training loop under samestep: the step protocol every driver shares (``protocol``), ``samestep.Run``
(``run``), what it checks before it starts (``start_checks``) and the mistakes it catches in the loop
(``step_checks``), and the token sources and data cursor a run resumes from (``data``)."""

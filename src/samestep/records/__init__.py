"""What a run leaves on disk: the run directory's files and paths (``rundir``), the receipt of each step
(``receipts``) and the state they digest (``receipt_state``), and every write that must survive a crash
(``durable``)."""

"""Measurement: one probe and how its figures are read (the step engine, timed and paired runs,
statistics, memory, ceilings, parity); nothing here knows of a study or a worker process."""

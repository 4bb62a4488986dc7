"""Measurement: what one probe does, and how its figures are read.

The step engine (:mod:`autotune.measure.step`) is the AMP training step written once, over the
precision table (:mod:`autotune.measure.precision`) and the model knobs
(:mod:`autotune.measure.knobs`). A timed run (:mod:`autotune.measure.timed`) is the measurement
policy over it; a probe (:mod:`autotune.measure.probe`) is one honestly timed run ending in a
:class:`~autotune.measure.result.ProbeResult`; a paired run (:mod:`autotune.measure.paired`)
interleaves a candidate's blocks with the reference's. Around them: medians with
distribution-free intervals (:mod:`autotune.measure.stats`), memory helpers
(:mod:`autotune.measure.memory`), batch ceilings (:mod:`autotune.measure.ceilings`) and loss
parity (:mod:`autotune.measure.parity`). Nothing here knows of a study or a worker process.
"""

"""Instability recovery: detectors (:mod:`.detect`), policies and rollback (:mod:`.recovery`), the LR ramp (:mod:`.lr_ramp`)."""

"""``raggedfn.map`` over nested values, batched: ``f`` runs once on stand-in samples
that record its ops (``_stand_ins.py``); the record runs once on the batch
(``_replay.py``)."""

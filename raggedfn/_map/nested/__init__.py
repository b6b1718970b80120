"""``raggedfn.map`` over nested values, batched: ``f`` runs once on stand-in samples
that record its ops (``_stand_ins.py``); the record runs once on the batch
(``_replay.py``). Inside ``torch.compile`` the record is made once, outside dynamo's
view, with every tensor named by where the compiled region has it (``_outer.py``),
and its replay is traced into the graph (``_program.py``)."""
